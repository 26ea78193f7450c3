"""One registry style: a class decorator that registers a class under its ``name`` attribute.

Used for scheduling policies (:mod:`vllm_mars.policies.base`) and admission controllers
(:mod:`vllm_mars.admission.base`). No vllm or torch import.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


class Registry(dict):
    """``name -> class``; :meth:`register` is the decorator. ``kind`` names the things in errors."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, cls: T) -> T:
        """Class decorator: register ``cls`` under ``cls.name`` (one class per name)."""
        name: Any = getattr(cls, "name", None)
        if not name:
            raise ValueError(f"{cls.__qualname__} has no name")
        if name in self and self[name] is not cls:
            raise ValueError(f"{self.kind} {name!r} is already registered by {self[name].__qualname__}")
        self[name] = cls
        return cls

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self)
