"""The contract between an admission controller and whoever feeds it (driver or sidecar).

Unit of admission: a root workflow. Later turns and children never queue here. The feeder calls
``offer`` when a root arrives, ``finish`` when it ends, ``observe`` with fresh telemetry, and
``tick`` on the controller's own clock (every ``interval_s``, and after each offer/finish), which
returns the roots admitted now. Controllers never reach into the engine: they only see telemetry.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from vllm_mars.options import check_options
from vllm_mars.registry import Registry


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
    """One reading of engine and tool-plane state: the one type every source produces (the
    in-process scheduler, a vLLM server's /metrics, the sidecar's pooled view). ``None`` fields
    are unknown to that source."""

    ts: float
    free_blocks: int | None = None       # allocatable now (free + evictable; retained are not free)
    total_blocks: int | None = None      # usable KV blocks (vLLM's null block excluded)
    block_size: int | None = None
    kv_usage: float | None = None        # 0..1
    prefix_hit_rate: float | None = None  # 0..1, recent
    tools_in_flight: int | None = None
    tool_workers: int | None = None
    tool_queue_wait_s: float | None = None  # EMA
    retained_blocks: int | None = None   # held for paused workflows (MarsScheduler retention)
    preemptions: int | None = None       # since the reader started
    recomputed_tokens: int | None = None
    kv_blocks_removed: int | None = None  # cached KV blocks evicted for reuse (vLLM KV cache events)
    running: int | None = None
    waiting: int | None = None

    @property
    def num_blocks(self) -> int | None:
        """``total_blocks`` under the engine's name."""
        return self.total_blocks

    def as_dict(self) -> dict[str, Any]:
        """The known fields (for event logs), in field order (every field is a scalar: no copy to make)."""
        return {k: v for k in _TELEMETRY_FIELDS if (v := getattr(self, k)) is not None}


_TELEMETRY_FIELDS = tuple(f.name for f in dataclasses.fields(Telemetry))


@dataclass(frozen=True)
class ToolStats:
    """The CPU tool plane: calls queued or running, workers (None: unlimited, simulated tools do
    not queue), EMA of the queue wait (s)."""

    in_flight: int
    workers: int | None
    ema_queue_wait_s: float | None = None


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


@dataclass(frozen=True)
class WindowConfig:
    """The window knobs every windowed controller shares (subclasses add their rules' fields)."""

    #: Upper bound of the window of active roots.
    window_max: int = 30
    #: Lower bound of the window; pressure never pushes the limit below this.
    window_min: int = 1
    #: Starting window (None: ``window_min``).
    window_init: int | None = None
    #: Control interval (s): the window changes at most this often; the feeder ticks this often.
    interval_s: float = 0.2
    #: Telemetry older than this (s) counts as pressure.
    stale_s: float = 2.0
    #: Active-root limit while no usable telemetry has been seen.
    no_telemetry_window: int = 2

    def _bad(self, name: str, allowed: str) -> ValueError:
        return ValueError(f"{type(self).__name__}.{name} = {getattr(self, name)!r}: must be {allowed}")

    def __post_init__(self) -> None:
        if self.window_min < 1:
            raise self._bad("window_min", ">= 1")
        if self.window_max < self.window_min:
            raise self._bad("window_max", f">= window_min ({self.window_min})")
        if self.window_init is not None and not self.window_min <= self.window_init <= self.window_max:
            raise self._bad("window_init",
                            f"within [window_min, window_max] = [{self.window_min}, {self.window_max}]")
        if not self.interval_s >= 0.01:
            raise self._bad("interval_s", ">= 0.01")
        if not self.stale_s > 0:
            raise self._bad("stale_s", "> 0")
        if self.no_telemetry_window < 1:
            raise self._bad("no_telemetry_window", ">= 1")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        return config_from_dict(cls, d)


@dataclass(frozen=True)
class NoOptions:
    """The config of a controller without knobs."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NoOptions:
        return config_from_dict(cls, d)


class ControllerBase:
    """What every controller shares: the queue (arrival order), the active set, the event list,
    the window, the blocks promised to newly admitted roots, and the feeder protocol. A subclass
    (registered with :func:`register_controller`) adds only its rules: ``tick`` (and, if it learns
    from finished workflows, ``_on_finish``).

    Promises: a root admitted at ``now`` with a footprint of ``blocks`` is promised those blocks
    until telemetry stamped at or after ``landing`` (``now`` + the controller's promise time) can
    show them. The controller is the only place that counts them; a feeder placing roots on
    replicas asks :meth:`promised_blocks` for the roots it placed there.
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type] = NoOptions

    def __init__(self, config: Any = None) -> None:
        self.config = cfg = config if config is not None else self.config_cls()
        self.interval_s: float = getattr(cfg, "interval_s", 0.2)
        init = getattr(cfg, "window_init", None)
        self.window: int = init if init is not None else getattr(cfg, "window_min", 1)
        self._queue: dict[str, PendingRoot] = {}  # insertion order = arrival order
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._active: dict[str, Any] = {}
        self._events: list[AdmissionEvent] = []
        self._tel: Telemetry | None = None
        self._pending: dict[str, tuple[float, int]] = {}  # wf -> (landing ts, blocks), admission order
        self._pending_sum = 0
        self.num_admitted = 0

    # -- feeding ----------------------------------------------------------------------------------
    def offer(self, root: PendingRoot) -> None:
        if root.workflow in self._queue or root.workflow in self._active:
            raise ValueError(f"root workflow {root.workflow!r} is already queued or active")
        if root.prefill_tokens is not None and root.prefill_tokens < 0:
            raise ValueError(f"PendingRoot.prefill_tokens must be >= 0, got {root.prefill_tokens}")
        self._queue[root.workflow] = root
        self._seq[root.workflow] = self._next_seq
        self._next_seq += 1
        if root.meta.get("returning"):
            # a softly ended workflow that came back goes ahead of new roots (after earlier returners)
            self._queue = dict(sorted(self._queue.items(), key=lambda kv: not self.returning(kv[1])))

    @staticmethod
    def returning(root: PendingRoot) -> bool:
        """``root`` is a workflow that was ended softly and came back (``meta["returning"]``)."""
        return bool(root.meta.get("returning"))

    def update_estimate(self, workflow: str, prefill_tokens: int, now: float) -> int | None:
        """A later call of ``workflow`` showed a larger prompt than it was offered with (its first
        call was a short side call): a queued root is re-estimated; an admitted root's outstanding
        promise grows to the new footprint. Returns the new footprint (None: no footprint model)."""
        fp = getattr(self, "footprint_blocks", None)
        q = self._queue.get(workflow)
        if q is not None:
            if q.prefill_tokens is None or prefill_tokens > q.prefill_tokens:
                self._queue[workflow] = q = dataclasses.replace(q, prefill_tokens=prefill_tokens)
            return fp(q) if fp is not None else None
        if workflow not in self._active or fp is None:
            return None
        self._on_reestimate(self._active[workflow], prefill_tokens, now)
        blocks = fp(PendingRoot(workflow, now, prefill_tokens))
        promise = self._pending.get(workflow)
        if promise is not None and blocks > promise[1]:
            self._pending[workflow] = (promise[0], blocks)
            self._pending_sum += blocks - promise[1]
        return blocks

    def _on_reestimate(self, active: Any, prefill_tokens: int, now: float) -> None:
        """Hook: an admitted root's prompt estimate grew (``active`` as stored by :meth:`_admit`)."""

    def observe_cached(self, workflow: str, cached_tokens: int) -> None:
        """The first call of admitted root ``workflow`` found ``cached_tokens`` of its prompt in the
        engine's prefix cache: KV it shares with other workflows (it had none of its own yet).
        Unknown roots and values that are not non-negative integers are ignored (the sidecar
        reports what servers answer)."""
        act = self._active.get(workflow)
        if act is not None and isinstance(cached_tokens, int) and not isinstance(cached_tokens, bool) \
                and cached_tokens >= 0:
            self._on_cached(act, cached_tokens)

    def _on_cached(self, active: Any, cached_tokens: int) -> None:
        """Hook: see :meth:`observe_cached`."""

    def finish(self, workflow: str, now: float, final_tokens: int | None = None,
               turns: int | None = None) -> None:
        """``workflow`` ended (or was cancelled while queued); see :class:`AdmissionController`."""
        if self._queue.pop(workflow, None) is not None:
            self._seq.pop(workflow, None)
            return
        if workflow not in self._active:
            return
        act = self._active.pop(workflow)
        promise = self._pending.pop(workflow, None)
        if promise is not None:
            self._pending_sum -= promise[1]
        self._on_finish(act, now, final_tokens, turns)

    def _on_finish(self, active: Any, now: float, final_tokens: int | None, turns: int | None) -> None:
        """Hook: an admitted root ended (``active`` is what :meth:`_admit` stored for it)."""

    def observe(self, telemetry: Telemetry) -> None:
        if self._tel is not None and telemetry.ts < self._tel.ts:
            return  # out-of-order reading: keep the newer one
        self._tel = telemetry

    def tick(self, now: float) -> list[str]:
        raise NotImplementedError

    def take_events(self) -> list[AdmissionEvent]:
        out, self._events = self._events, []
        return out

    def _emit(self, now: float, event: str, data: dict[str, Any]) -> None:
        self._events.append(AdmissionEvent(now, event, {"controller": self.name, **data}))

    # -- admitting --------------------------------------------------------------------------------
    def adopt(self, root: PendingRoot, now: float) -> None:
        """``root`` is already running and joins this controller (it was moved here off a backend
        that left): it is active at once, over the limit if need be (new roots then wait until the
        active set is below the limit again), and its footprint is promised here until telemetry
        can show it. No admission event: it was admitted once, where it started."""
        self.offer(root)
        record, blocks, promise_s = self._adoption(root, now)
        self._admit(self._queue[root.workflow], now, record, blocks, promise_s)
        self.num_admitted -= 1  # admitted once already, where it started

    def _adoption(self, root: PendingRoot, now: float) -> tuple[Any, int, float]:
        """Hook: what :meth:`adopt` stores for ``root`` (as :meth:`_admit`'s ``record``), the blocks
        it promises and for how long (default: footprint blocks when the controller has a model)."""
        fp = getattr(self, "footprint_blocks", None)
        return True, (fp(root) if fp is not None else 0), float(getattr(self.config, "promise_s", 0.0))

    def _admit(self, root: PendingRoot, now: float, record: Any = True, blocks: int = 0,
               promise_s: float = 0.0) -> None:
        """Move ``root`` from the queue to the active set, promising ``blocks`` until ``now + promise_s``."""
        wf = root.workflow
        self._active[wf] = record
        if blocks:
            self._pending[wf] = (now + promise_s, blocks)
            self._pending_sum += blocks
        del self._queue[wf]
        self._seq.pop(wf, None)
        self.num_admitted += 1

    def _promised(self) -> int:
        """Blocks of admitted roots that the last telemetry cannot show yet (kept incrementally:
        admissions land in admission order, and telemetry time only moves forward)."""
        t = self._tel
        if t is not None:
            pending = self._pending
            while pending:
                wf = next(iter(pending))
                landing, blocks = pending[wf]
                if landing > t.ts:
                    break
                del pending[wf]
                self._pending_sum -= blocks
        return self._pending_sum

    def promised_blocks(self, workflows: Iterable[str] | None = None) -> int:
        """Outstanding promised blocks: all of them, or those of ``workflows`` (one replica's roots)."""
        total = self._promised()
        if workflows is None:
            return total
        return sum(self._pending[w][1] for w in workflows if w in self._pending)

    # -- state ------------------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def is_active(self, workflow: str) -> bool:
        return workflow in self._active

    def is_queued(self, workflow: str) -> bool:
        return workflow in self._queue

    def limit(self) -> int:
        """Active-root limit now."""
        return self.window

    def _telemetry_usable(self) -> bool:
        """The last telemetry gave free and total blocks."""
        t = self._tel
        return t is not None and t.free_blocks is not None and bool(t.total_blocks)

    def _usage(self) -> float | None:
        """KV usage by the last telemetry (its own reading, else from free and total blocks)."""
        t = self._tel
        if t is None:
            return None
        if t.kv_usage is not None:
            return t.kv_usage
        if t.free_blocks is not None and t.total_blocks:
            return 1.0 - t.free_blocks / t.total_blocks
        return None

    def snapshot(self) -> dict[str, Any]:
        """State for /metrics and debugging."""
        return {"controller": self.name, "window": self.window, "limit": self.limit(),
                "active": len(self._active), "queued": len(self._queue), "admitted": self.num_admitted,
                "config": dataclasses.asdict(self.config)}


_REGISTRY: Registry = Registry("controller")
#: Class decorator: register a controller class under its ``name``.
register_controller = _REGISTRY.register


def _load_builtins() -> None:
    # lazy: the built-in controllers import this module (they subclass ControllerBase)

    for mod in ("mars", "concur", "cap"):  # registers "mars", "concur", "cap"
        importlib.import_module(f"vllm_mars.admission.{mod}")


def available_controllers() -> list[str]:
    """Registered controller names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


@register_controller
class NoneController(ControllerBase):
    """Admit every root at once (the baselines, and the ``mars-no-admission`` ablation)."""

    name = "none"

    def tick(self, now: float) -> list[str]:
        admitted = list(self._queue.values())
        for r in admitted:
            self._admit(r, now)
            self._emit(now, "admission_admit", {"workflow": r.workflow})
        return [r.workflow for r in admitted]

    def limit(self) -> int:
        return -1  # unlimited

    def snapshot(self) -> dict[str, Any]:
        return {"controller": self.name, "active": len(self._active), "queued": len(self._queue),
                "admitted": self.num_admitted}


def config_from_dict(cls: type, d: Mapping[str, Any]) -> Any:
    """Build the config dataclass ``cls`` from ``d`` with the one options validator
    (:func:`vllm_mars.options.check_options`: unknown keys, wrong types, non-finite numbers)."""
    if d and not dataclasses.fields(cls):
        raise ValueError(f"this admission controller takes no options, got {sorted(d)}")
    return check_options(cls, d, owner=cls.__name__)


def get_controller_class(name: str) -> type[ControllerBase]:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown admission controller {name!r}; available: "
                         f"{', '.join(available_controllers())}") from None


def make_controller(name: str, options: Mapping[str, Any] | None = None) -> ControllerBase:
    """Build a registered controller by name with its config options (validated)."""
    cls = get_controller_class(name)
    return cls(cls.config_cls.from_dict(dict(options or {})))
