"""Root workflow lifecycle in the sidecar, on an injected clock (no HTTP, no event loop).

A root is created by the first call of any of its sessions and offered to the controller; it is
admitted when the controller says so (``on_admit``), then placed on a backend. It ends
(``on_end``, controller ``finish``) when:

* the finish route names it;
* a call of the root session carrying ``mars_last_step`` ends, however it ended (success, an
  error status, a broken upstream or a client that went away): the workflow said it was done;
* a one-call (anonymous) workflow's call ends;
* its backend failed under it (its KV is gone; its next call queues again as a new root);
* it had no call for ``idle_timeout_s``, or its last call failed and no call followed for
  ``failed_idle_timeout_s`` (a workflow whose call failed does not keep a slot it is not using);
* the last call waiting for its admission left (cancelled while queued).

Everything reads time from ``clock``, so the lifecycle can run in virtual time
(:class:`vllm_mars.clock.VirtualClock`), like the controllers and the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_mars.admission.base import PendingRoot
from vllm_mars.admission.identity import Identity, SessionTable
from vllm_mars.clock import Clock

logger = logging.getLogger(__name__)


class RootState:
    """One root workflow known to the sidecar."""

    __slots__ = ("admitted", "backend", "blocks", "failed", "in_flight", "last_activity", "root", "tokens",
                 "waiter", "waiters")

    def __init__(self, root: str, now: float) -> None:
        self.root = root
        #: the backend it was placed on at admission (opaque here)
        self.backend: Any = None
        self.admitted = False
        #: whatever the feeder waits on until admission (an asyncio future in the sidecar)
        self.waiter: Any = None
        #: calls waiting for admission
        self.waiters = 0
        self.in_flight = 0
        self.last_activity = now
        #: the controller's footprint estimate at arrival (0 when it has none)
        self.blocks = 0
        #: the largest ``usage.total_tokens`` seen in this workflow's responses (its KV size so far)
        self.tokens = 0
        #: the last call ended in an error
        self.failed = False


class RootTable:
    """Roots, sessions and turn counters, tied to one controller (see the module docstring)."""

    def __init__(self, controller: Any, clock: Clock, *, idle_timeout_s: float, failed_idle_timeout_s: float,
                 place: Callable[[RootState], Any] | None = None,
                 on_admit: Callable[[RootState], None] | None = None,
                 on_end: Callable[[RootState], None] | None = None,
                 counters: dict[str, int] | None = None) -> None:
        self.controller = controller
        self.clock = clock
        self.idle_timeout_s = idle_timeout_s
        self.failed_idle_timeout_s = failed_idle_timeout_s
        self._place = place
        self._on_admit = on_admit
        self._on_end = on_end
        self.roots: dict[str, RootState] = {}
        self.sessions = SessionTable()
        self.turns: dict[str, int] = {}
        #: ends by cause (shared with the feeder's counters when it passes its dict)
        self.counters = counters if counters is not None else {}
        for k in ("finished", "idle_finished", "failed_finished"):
            self.counters.setdefault(k, 0)
        #: whether any backend is up; admission pauses while none is (queued roots keep waiting)
        self.live = True

    def get(self, root: str) -> RootState | None:
        return self.roots.get(root)

    # -- arrival and admission --------------------------------------------------------------------
    def arrive(self, ident: Identity, prefill_tokens: int | None) -> RootState:
        """The state of ``ident``'s root, offering a new root to the controller (and ticking it,
        so a free slot admits it at once). Check ``admitted`` on the result."""
        now = self.clock.now()
        r = self.roots.get(ident.root)
        if r is not None:
            if r.admitted:
                r.last_activity = now
            return r
        r = RootState(ident.root, now)
        self.roots[ident.root] = r
        root = PendingRoot(ident.root, now, prefill_tokens, {"source": ident.source})
        self.controller.offer(root)
        fp = getattr(self.controller, "footprint_blocks", None)
        r.blocks = fp(root) if fp is not None else 0
        self.tick()
        return r

    def tick(self) -> list[RootState]:
        """Let the controller admit roots (not while no backend is up); returns those admitted."""
        if not self.live:
            return []
        now = self.clock.now()
        out = []
        for wf in self.controller.tick(now):
            r = self.roots.get(wf)
            if r is None:  # cancelled meanwhile
                self.controller.finish(wf, now)
                continue
            r.admitted = True
            r.last_activity = now
            if self._place is not None:
                r.backend = self._place(r)
            if self._on_admit is not None:
                self._on_admit(r)
            out.append(r)
        return out

    def left_waiting(self, r: RootState) -> None:
        """A call stopped waiting for ``r``'s admission; the last one leaving cancels the root."""
        r.waiters -= 1
        if not r.admitted and r.waiters == 0 and self.roots.get(r.root) is r:
            del self.roots[r.root]
            self.controller.finish(r.root, self.clock.now())
            self.sessions.forget_root(r.root)
            self.tick()

    # -- calls ------------------------------------------------------------------------------------
    def call_started(self, r: RootState, ident: Identity) -> int:
        """Count a call in flight; returns its turn number within its session."""
        r.in_flight += 1
        turn = self.turns.get(ident.workflow, 0)
        self.turns[ident.workflow] = turn + 1
        return turn

    def call_ended(self, r: RootState, ident: Identity, ok: bool) -> None:
        """A call of ``r`` ended; ``ok`` False for an error status, a broken upstream or a client
        that went away. Ends the root when the call was its last step or a one-call workflow."""
        r.in_flight -= 1
        r.last_activity = self.clock.now()
        r.failed = not ok
        if ident.anonymous:
            self.turns.pop(ident.workflow, None)
        if self.roots.get(ident.root) is r and (ident.anonymous or (ident.last_step and ident.is_root)):
            self.finish(ident.root)

    # -- ending -----------------------------------------------------------------------------------
    def finish(self, root: str, final_tokens: int | None = None) -> bool:
        """End ``root`` (admitted or queued); False when it is not known."""
        r = self.roots.pop(root, None)
        if r is None:
            return False
        if final_tokens is None and r.tokens:
            final_tokens = r.tokens  # with the root session's call count: how much workflows grow per turn
        self.controller.finish(root, self.clock.now(), final_tokens, turns=self.turns.get(root))
        for session in self.sessions.forget_root(root):
            self.turns.pop(session, None)
        self.counters["finished"] += 1
        if self._on_end is not None:
            self._on_end(r)
        self.tick()
        return True

    def expire(self) -> list[str]:
        """End admitted roots idle past their timeout; returns them."""
        now = self.clock.now()
        out = []
        for r in list(self.roots.values()):
            if not r.admitted or r.in_flight:
                continue
            idle = now - r.last_activity
            if idle > self.idle_timeout_s:
                self.counters["idle_finished"] += 1
            elif r.failed and idle > self.failed_idle_timeout_s:
                self.counters["failed_finished"] += 1
            else:
                continue
            out.append(r.root)
            self.finish(r.root)
        return out
