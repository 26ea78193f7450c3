"""Admission per replica: one controller per backend, each root placed when it arrives.

:class:`ReplicaAdmission` is the one placement + admission logic of a fleet. The sidecar with
several backends (``--backend`` URLs, or the data-parallel ranks of one), the Ray Serve gate (its
replicas) and the cluster sim (``--replicas N``) all use it:

* a new root is placed when it is offered, by the shared
  :class:`~vllm_mars.admission.placement.Placement` (its rule; the root's first prompt tokens for the
  ``mars`` rule's prefix term, when known), and queued at that backend's own controller; its later
  turns and children stay there (the feeder routes them by :meth:`ReplicaAdmission.backend_of`);
* each controller is fed its own backend's reading (:meth:`ReplicaAdmission.observe`), so its
  window and KV budget are that backend's; a backend that is down gets no reading (its controller
  sees its last one age: pressure, never blind admission);
* as the Placement's controller it answers ``promised_blocks(roots of one backend)``: the blocks
  that backend's controller promised to admitted roots, plus the footprints of the roots queued
  there (placed, not yet admitted);
* a root queued at a backend that went down, or left the fleet, is placed again on a live one and
  queued there (in its arrival order); an admitted root whose backend cannot be reached is moved by
  :meth:`ReplicaAdmission.place` (the feeder's re-placement);
* a moved admitted root is **counted at its new backend at once**: it is already running (its next
  call goes there), so its new controller adopts it as active
  (:meth:`~vllm_mars.admission.base.ControllerBase.adopt`), over that backend's window if need be,
  and promises its footprint there. The window absorbs it: that controller admits no new root until
  its active set is below its limit again. (Queueing it first instead would let the backend admit a
  full window of new roots next to a root that runs anyway: one root over its window.)
* a backend that leaves the fleet (a Ray replica that died; it is no longer in the placement's
  backends) has its controller **retired**: its admitted roots move as above, its queued roots queue
  again at live backends, and its controller leaves every sum (window, limit, /metrics). A backend
  that comes back is a new backend object and gets a fresh controller.
* thread safety: every method runs under :attr:`ReplicaAdmission.lock` (an ``RLock``); a reader on
  another thread (the Ray Serve router scoring replicas by :meth:`Placement.score`) takes it too, as
  those reads also update controller state (promises that landed are dropped).

It speaks the controller protocol of :mod:`vllm_mars.admission.base` (``offer``, ``tick``,
``observe``, ``finish``, ...), so the driver and the sidecar's root table feed it as one
controller. Events carry their backend's label (the sim: the replica's index; else its name).

Why not one controller over the summed reading: at 16-64 replicas it held roots for 200-1,000 s
(experiments/scale_out/README.md); per replica, a root waits only for its own replica.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from vllm_mars.admission.base import AdmissionEvent, PendingRoot, Telemetry
from vllm_mars.admission.placement import Placement

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(f: _F) -> _F:
    """Run the method under its instance's :attr:`ReplicaAdmission.lock`."""
    @functools.wraps(f)
    def run(self: ReplicaAdmission, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return f(self, *args, **kwargs)
    return run  # type: ignore[return-value]


def own_readings(backends: Sequence[Any], fed: Telemetry) -> list[Telemetry | None]:
    """Each backend's last reading while it is up (None: down); the default ``readings``."""
    return [b.telemetry.last if b.up else None for b in backends]


class ReplicaAdmission:
    """One controller per backend of ``placement`` (see the module docstring).

    ``make()`` builds a controller (one per backend; ``first``, when given, is the first backend's);
    ``prompt_of(root)``: a new root's prompt token ids, for the ``mars`` rule's prefix term;
    ``place(root, tokens)``: how a new root is placed (default ``placement.place``; the sim counts
    its placements); ``readings(backends, fed)``: each backend's reading when fed ``fed``
    (default :func:`own_readings`); ``label(backend)``: the backend in events (default its name);
    ``lazy``: tick only the controllers with something new (an offer, a finish, a reading), as the
    virtual-time driver does; else every controller on every tick (a live feeder's window grows
    with time). ``clock()``: now, for moves (default: the last tick's time)."""

    def __init__(self, placement: Placement, make: Callable[[], Any], *, first: Any = None,
                 prompt_of: Callable[[str], Sequence[int] | None] | None = None,
                 place: Callable[[str, Sequence[int] | None], Any] | None = None,
                 readings: Callable[[Sequence[Any], Telemetry], Sequence[Telemetry | None]] | None = None,
                 label: Callable[[Any], Any] | None = None, lazy: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        #: held by every method; take it to read this state from another thread (see the module docstring)
        self.lock = threading.RLock()
        self.placement = placement
        placement.controller = self
        self._make = make
        self._first: Any = first if first is not None else make()
        self.name = self._first.name
        self.interval_s = self._first.interval_s
        self.config = getattr(self._first, "config", None)
        self._prompt_of = prompt_of
        self._place_new = place if place is not None else placement.place
        self._readings = readings if readings is not None else own_readings
        self._label = label if label is not None else (lambda b: b.name)
        self._lazy = lazy
        self._clock = clock
        self._now = 0.0
        self._cost: Any = None
        #: the backends with a controller, in the order they were first seen, and their controllers
        self.backends: list[Any] = []
        self.ctrls: list[Any] = []
        self._slot_of: dict[int, int] = {}  # id(backend) -> its index
        #: root -> its backend's index (offered, until finished)
        self._of: dict[str, int] = {}
        #: per backend: its roots waiting for admission
        self._queued: list[dict[str, PendingRoot]] = []
        #: roots moved while admitted to a controller that cannot adopt: queued there, running meanwhile
        self._moved: set[str] = set()
        #: root -> its latest prompt estimate (a moved root is queued again with it)
        self._prefill: dict[str, int | None] = {}
        #: backends whose controller has something new to decide
        self._dirty: set[int] = set()
        #: events of retired controllers, not taken yet
        self._retired_events: list[AdmissionEvent] = []
        #: controllers retired (their backends left the fleet), and the roots they had admitted
        self.retired = 0
        self._retired_admitted = 0
        self.sync()

    # -- backends -----------------------------------------------------------------------------------
    @_locked
    def sync(self) -> None:
        """Give every backend of the placement a controller (backends join later: Ray replicas), and
        retire the controllers of backends that left it (see the module docstring)."""
        current = self.placement.backends
        for b in current:
            if id(b) not in self._slot_of:
                self._slot(b)
        if len(self.backends) > len(current) and current:  # some left (each current one has a slot)
            here = {id(b) for b in current}
            for i in reversed([i for i, b in enumerate(self.backends) if id(b) not in here]):
                self._retire(i)

    def _retire(self, i: int) -> None:
        """Backend ``i`` left the fleet: its roots move to live backends, its controller goes."""
        gone = self.backends[i]
        admitted = [wf for wf, j in self._of.items() if j == i and wf not in self._queued[i]]
        for wf in admitted + list(self._queued[i]):
            self._move(wf, i)
        c = self.ctrls[i]
        evs = c.take_events()
        if evs:
            lab = self._label(gone)
            self._retired_events += [AdmissionEvent(e.ts, e.event, {**e.data, "replica": lab}) for e in evs]
        self._retired_admitted += getattr(c, "num_admitted", 0)
        del self.backends[i], self.ctrls[i], self._queued[i]
        self._slot_of = {id(b): k for k, b in enumerate(self.backends)}
        self._of = {wf: (j - 1 if j > i else j) for wf, j in self._of.items()}
        self._dirty = {j - 1 if j > i else j for j in self._dirty if j != i}
        self.retired += 1

    def _slot(self, b: Any) -> int:
        i = self._slot_of.get(id(b))
        if i is None:
            i = self._slot_of[id(b)] = len(self.backends)
            if self._first is not None:  # the first backend's (once: a backend after it gets a fresh one)
                c, self._first = self._first, None
            else:
                c = self._make()
                if self._cost is not None and hasattr(c, "set_cost_model"):
                    c.set_cost_model(self._cost)
            self.backends.append(b)
            self.ctrls.append(c)
            self._queued.append({})
        return i

    def backend_of(self, workflow: str) -> Any:
        """The backend root ``workflow`` is placed on (None: not offered here, or finished)."""
        i = self._of.get(workflow)
        return None if i is None else self.backends[i]

    # -- the controller protocol --------------------------------------------------------------------
    @_locked
    def set_cost_model(self, cost: Any) -> None:
        self._cost = cost
        for c in [*self.ctrls, *([self._first] if self._first is not None else [])]:
            if hasattr(c, "set_cost_model"):
                c.set_cost_model(cost)

    @_locked
    def offer(self, root: PendingRoot) -> None:
        wf = root.workflow
        if wf in self._of:
            raise ValueError(f"root workflow {wf!r} is already queued or active")
        b = self._place_new(wf, self._prompt_of(wf) if self._prompt_of is not None else None)
        self._prefill[wf] = root.prefill_tokens
        self._queue_at(self._slot(b), root)

    def _queue_at(self, i: int, root: PendingRoot) -> None:
        self.ctrls[i].offer(root)
        self._of[root.workflow] = i
        self._queued[i][root.workflow] = root
        self._dirty.add(i)

    @_locked
    def tick(self, now: float) -> list[str]:
        self._now = now
        out: list[str] = []
        for i in (sorted(self._dirty) if self._lazy else range(len(self.ctrls))):
            admitted = self.ctrls[i].tick(now)
            q = self._queued[i]
            for wf in admitted:
                q.pop(wf, None)
            if self._moved:
                admitted = [wf for wf in admitted if not self._was_moved(wf)]
            out += admitted
        self._dirty.clear()
        return out

    def _was_moved(self, wf: str) -> bool:
        if wf in self._moved:
            self._moved.discard(wf)
            return True
        return False

    @_locked
    def observe(self, telemetry: Telemetry) -> None:
        """Give each controller its own backend's reading (``readings``, from the fed one)."""
        self.sync()
        for c, reading in zip(self.ctrls, self._readings(self.backends, telemetry), strict=True):
            if reading is not None:
                c.observe(reading)
        self._dirty.update(range(len(self.ctrls)))
        self._requeue_stranded()

    @_locked
    def finish(self, workflow: str, now: float, final_tokens: int | None = None,
               turns: int | None = None) -> None:
        i = self._of.pop(workflow, None)
        if i is None:
            return
        self._queued[i].pop(workflow, None)
        self._moved.discard(workflow)
        self._prefill.pop(workflow, None)
        self.ctrls[i].finish(workflow, now, final_tokens=final_tokens, turns=turns)
        Placement.release(workflow, self.backends[i])
        self._dirty.add(i)

    @_locked
    def update_estimate(self, workflow: str, prefill_tokens: int, now: float) -> int | None:
        i = self._of.get(workflow)
        if i is None:
            return None
        if (self._prefill.get(workflow) or 0) < prefill_tokens:
            self._prefill[workflow] = prefill_tokens
        q = self._queued[i]
        if workflow in q and (q[workflow].prefill_tokens or 0) < prefill_tokens:
            q[workflow] = replace(q[workflow], prefill_tokens=prefill_tokens)
        return self.ctrls[i].update_estimate(workflow, prefill_tokens, now)

    @_locked
    def observe_cached(self, workflow: str, cached_tokens: int) -> None:
        i = self._of.get(workflow)
        if i is not None:
            self.ctrls[i].observe_cached(workflow, cached_tokens)

    @_locked
    def footprint_blocks(self, root: PendingRoot) -> int:
        """``root``'s footprint by the controller of its backend (0: that controller has no model)."""
        i = self._of.get(root.workflow, 0)
        fp = getattr(self.ctrls[i], "footprint_blocks", None) if i < len(self.ctrls) else None
        return fp(root) if fp is not None else 0

    @_locked
    def take_events(self) -> list[AdmissionEvent]:
        out, self._retired_events = self._retired_events, []
        for b, c in zip(self.backends, self.ctrls, strict=True):
            evs = c.take_events()
            if evs:
                lab = self._label(b)
                out += [AdmissionEvent(e.ts, e.event, {**e.data, "replica": lab}) for e in evs]
        return out

    @property
    def num_active(self) -> int:
        return sum(c.num_active for c in self.ctrls)

    @property
    def num_queued(self) -> int:
        return sum(c.num_queued for c in self.ctrls)

    @property
    def num_admitted(self) -> int:
        return self._retired_admitted + sum(getattr(c, "num_admitted", 0) for c in self.ctrls)

    @_locked
    def limit(self) -> int:
        """The backends' active-root limits summed (-1: one is unlimited)."""
        lims = [c.limit() if hasattr(c, "limit") else -1 for c in self.ctrls]
        return -1 if any(v < 0 for v in lims) else sum(lims)

    @_locked
    def snapshot(self) -> dict[str, Any]:
        """For /metrics: the summed window and limit, and each backend's controller."""
        per = [{"backend": str(self._label(b)), **(c.snapshot() if hasattr(c, "snapshot") else {})}
               for b, c in zip(self.backends, self.ctrls, strict=True)]
        return {"controller": self.name, "admission": "per-replica",
                "window": sum(int(p.get("window", 0)) for p in per), "limit": self.limit(),
                "active": self.num_active, "queued": self.num_queued, "per_replica": per}

    # -- for the Placement --------------------------------------------------------------------------
    @_locked
    def promised_blocks(self, workflows: Iterable[str] | None = None) -> int:
        """Blocks owed on one backend (``workflows``: the roots placed there), or on all (None)."""
        if workflows is None:
            return sum(self._owed(i) for i in range(len(self.ctrls)))
        for wf in workflows:
            i = self._of.get(wf)
            if i is not None:
                return self._owed(i)
        return 0

    def _owed(self, i: int) -> int:
        c = self.ctrls[i]
        promised = getattr(c, "promised_blocks", None)
        owed = promised() if promised is not None else 0
        fp = getattr(c, "footprint_blocks", None)
        if fp is not None:
            owed += sum(fp(q) for q in self._queued[i].values())
        return owed

    # -- moves --------------------------------------------------------------------------------------
    @_locked
    def release(self, root: str, b: Any) -> None:
        """The feeder takes ``root`` off ``b`` before placing it again (:meth:`place`)."""
        Placement.release(root, b)

    @_locked
    def place(self, root: str, tokens: Sequence[int] | None = None) -> Any:
        """Place root ``root`` again now (its backend cannot be reached): it leaves its controller
        and joins the new backend's: queued ahead of new roots while it waits still, adopted as
        active at once when it was admitted (it runs already). Returns the new backend."""
        i = self._of.get(root)
        if i is None:  # not offered here: a plain placement
            return self.placement.place(root, tokens)
        return self.backends[self._move(root, i, tokens)]

    def _move(self, wf: str, i: int, tokens: Sequence[int] | None = None) -> int:
        now = self._clock() if self._clock is not None else self._now
        queued = self._queued[i].pop(wf, None)
        self._of.pop(wf)
        self.ctrls[i].finish(wf, now)
        Placement.release(wf, self.backends[i])
        self._dirty.add(i)
        if tokens is None and self._prompt_of is not None:
            tokens = self._prompt_of(wf)
        j = self._slot(self.placement.place(wf, tokens))
        if queued is not None:  # waiting still: it keeps its place in arrival order (a returner)
            self._queue_at(j, replace(queued, meta={**queued.meta, "returning": True, "moved": True}))
            return j
        root = PendingRoot(wf, now, self._prefill.get(wf), {"returning": True, "moved": True})
        adopt = getattr(self.ctrls[j], "adopt", None)
        if adopt is None:  # a controller without adopt: queued first, running meanwhile
            self._moved.add(wf)
            self._queue_at(j, root)
            return j
        adopt(root, now)  # running already: counted there at once (see the module docstring)
        self._of[wf] = j
        self._dirty.add(j)
        return j

    def _requeue_stranded(self) -> None:
        """Roots queued at a backend that is down, or left the fleet, are placed again on a live one."""
        live = {id(b) for b in self.placement.backends if b.up}
        if not live or len(live) == len(self.backends):
            return
        for i, b in enumerate(self.backends):
            if id(b) not in live and self._queued[i]:
                for wf in list(self._queued[i]):
                    self._move(wf, i)
