"""The contract between an admission controller and whoever feeds it (driver or sidecar).

Unit of admission: a root workflow. Later turns and children never queue here. The feeder calls
``offer`` when a root arrives, ``finish`` when it ends, ``observe`` with fresh telemetry, and
``tick`` on the controller's own clock (every ``interval_s``, and after each offer/finish), which
returns the roots admitted now. Controllers never reach into the engine: they only see telemetry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class PendingRoot:
    """A root workflow waiting for admission."""

    workflow: str
    arrival: float
    #: caller's estimate of the first call's prompt tokens (None: unknown)
    prefill_tokens: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Telemetry:
    """One reading of engine and tool-plane state. ``None`` fields are unknown."""

    ts: float
    free_blocks: int | None = None       # allocatable now (free + evictable; retained are not free)
    total_blocks: int | None = None
    block_size: int | None = None
    kv_usage: float | None = None        # 0..1
    prefix_hit_rate: float | None = None  # 0..1, recent
    tools_in_flight: int | None = None
    tool_workers: int | None = None
    tool_queue_wait_s: float | None = None  # EMA


@dataclass(frozen=True)
class AdmissionEvent:
    """A decision and the inputs that produced it (``admission_window|admit|pressure``)."""

    ts: float
    event: str
    data: dict[str, Any]


class AdmissionController(Protocol):
    name: str
    interval_s: float

    def offer(self, root: PendingRoot) -> None: ...

    def finish(self, workflow: str, now: float, final_tokens: int | None = None,
               turns: int | None = None) -> None:
        """``workflow`` ended, or was cancelled while queued. Optional: ``final_tokens`` (its last
        call's prompt+output tokens) and ``turns`` (its LLM calls), which a controller may use to
        learn how much workflows grow per turn."""
        ...

    def observe(self, telemetry: Telemetry) -> None: ...

    def tick(self, now: float) -> list[str]:
        """Root workflow ids admitted now, in admission order."""
        ...

    def take_events(self) -> list[AdmissionEvent]: ...

    @property
    def num_active(self) -> int: ...

    @property
    def num_queued(self) -> int: ...


class NoneController:
    """Admit every root at once (the baselines, and the ``mars-no-admission`` ablation)."""

    name = "none"
    interval_s = 0.2

    def __init__(self) -> None:
        self._queued: list[PendingRoot] = []
        self._active: set[str] = set()
        self._events: list[AdmissionEvent] = []

    def offer(self, root: PendingRoot) -> None:
        self._queued.append(root)

    def finish(self, workflow: str, now: float, final_tokens: int | None = None,
               turns: int | None = None) -> None:
        self._queued = [r for r in self._queued if r.workflow != workflow]
        self._active.discard(workflow)

    def observe(self, telemetry: Telemetry) -> None:
        pass

    def tick(self, now: float) -> list[str]:
        admitted = [r.workflow for r in self._queued]
        self._queued.clear()
        self._active.update(admitted)
        self._events.extend(AdmissionEvent(now, "admission_admit", {"workflow": w, "controller": "none"})
                            for w in admitted)
        return admitted

    def take_events(self) -> list[AdmissionEvent]:
        out, self._events = self._events, []
        return out

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def snapshot(self) -> dict[str, Any]:
        return {"controller": self.name, "active": len(self._active), "queued": len(self._queued)}


CONTROLLERS = ("mars", "concur", "none")


def config_from_dict(cls: type, d: Mapping[str, Any]) -> Any:
    """Build the config dataclass ``cls`` from ``d``: unknown keys and values of the wrong type are a
    ValueError naming the field and what is allowed."""
    from vllm_mars.config import check_options

    return check_options(cls, d, owner=cls.__name__)


def make_controller(name: str, options: dict[str, Any] | None = None) -> AdmissionController:
    """Build a controller by name (``mars``, ``concur``, ``none``) with its config options."""
    options = dict(options or {})
    if name == "none":
        if options:
            raise ValueError(f"the 'none' admission controller takes no options, got {sorted(options)}")
        return NoneController()
    if name == "mars":
        from vllm_mars.admission.controller import MarsAdmissionConfig, MarsAdmissionController

        return MarsAdmissionController(MarsAdmissionConfig.from_dict(options))
    if name == "concur":
        from vllm_mars.admission.concur import ConcurConfig, ConcurController

        return ConcurController(ConcurConfig.from_dict(options))
    raise ValueError(f"unknown admission controller {name!r}; available: {', '.join(CONTROLLERS)}")
