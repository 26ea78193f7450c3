"""The one options validator: typed checks of config dataclasses built from JSON/TOML/CLI options.

The ground floor: no import from the rest of the package, so every layer (the policies, the
admission controllers, the engine config, the driver, the workloads) validates its options here
without importing the layers above it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

_SCALARS = ("bool", "int", "float", "str")


def check_value(name: str, annotation: Any, value: Any, *, minimum: float | None = None,
                maximum: float | None = None, above: float | None = None) -> Any:
    """Check one option against its annotation (``bool``, ``int``, ``float``, ``str``, ``X | None``;
    others pass) and an optional range; ValueError naming ``name``. Floats must be finite: NaN
    passes every ``<`` check, so a range alone never catches it. Returns ``value``."""
    ann = str(getattr(annotation, "__name__", annotation)).replace(" ", "")
    optional = "|None" in ann or "None|" in ann or ann.startswith("Optional[")
    base = ann.replace("|None", "").replace("None|", "").removeprefix("Optional[").removesuffix("]")
    if value is None:
        if optional or base not in _SCALARS:
            return value
        raise ValueError(f"{name} must be {base}, got None")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {"bool": isinstance(value, bool), "int": number and isinstance(value, int),
          "float": number, "str": isinstance(value, str)}.get(base, True)
    if not ok:
        raise ValueError(f"{name} must be {base}, got {value!r}")
    if number:
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum:g}, got {value!r}")
        if above is not None and value <= above:
            raise ValueError(f"{name} must be > {above:g}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{name} must be <= {maximum:g}, got {value!r}")
    return value


def check_choice(name: str, value: Any, allowed: tuple[str, ...] | list[str]) -> Any:
    """``value`` if it is one of ``allowed``, else ValueError naming ``name`` and every allowed value."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} {value!r} unknown; allowed: {', '.join(allowed)}")
    return value


def check_options(cls: type, options: Mapping[str, Any] | None, *, owner: str = "", context: str = "",
                  convert_lists: bool = False) -> Any:
    """Build config dataclass ``cls`` from ``options``.

    Unknown keys, values of the wrong type (a bool where an int is due, an int where a bool is
    due) and non-finite floats are a ValueError naming the key and what is allowed; the
    dataclass's own ``__post_init__`` then checks ranges. ``owner``/``context`` word the unknown-key
    message (``unknown <owner> key(s) [...]<context>; valid keys: ...``). ``convert_lists`` turns
    JSON/TOML lists into tuples (for tuple fields).
    """
    options = dict(options or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        what = " ".join(w for w in ("unknown", owner, "key(s)") if w)
        raise ValueError(f"{what} {unknown}{context}; valid keys: {', '.join(fields) or '(none)'}")
    for k, v in options.items():
        check_value(f"{cls.__name__}.{k}", fields[k].type, v)
    if convert_lists:
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None


def check_fields(obj: Any, ranges: Mapping[str, Mapping[str, float]], prefix: str = "") -> None:
    """``check_value`` on every field of dataclass instance ``obj`` (types from its annotations,
    ranges from ``ranges``); the error names ``prefix + field``."""
    for f in dataclasses.fields(obj):
        check_value(prefix + f.name, f.type, getattr(obj, f.name), **ranges.get(f.name, {}))


def check_nonneg(cfg: Any, *names: str) -> None:
    """Each named field of ``cfg`` must be a number >= 0 (ValueError naming the field)."""
    for n in names:
        v = getattr(cfg, n)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{n} must be a number >= 0, got {v!r}")


def dataclass_doc(cls: type) -> list[tuple[str, Any]]:
    """(field, default) pairs of a config dataclass, for ``mars policies`` listings."""
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, f.default))
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out.append((f.name, f.default_factory()))  # type: ignore[misc]
        else:
            out.append((f.name, None))
    return out
