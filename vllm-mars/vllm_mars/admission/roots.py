"""Root workflow lifecycle in the sidecar, on an injected clock (no HTTP, no event loop).

A root is created by the first call of any of its sessions and offered to the controller; it is
admitted when the controller says so (``on_admit``), then placed on a backend. It ends
(``on_end``, controller ``finish``) when:

* the finish route names it;
* a call of the root session carrying ``mars_last_step`` ends, however it ended (success, an
  error status, a broken upstream or a client that went away): the workflow said it was done;
* a one-call (anonymous) workflow's call ends;
* its backend failed under it (its KV is gone; its next call queues again as a new root);
* it had no call for the idle timeout, or its last call failed and no call followed for
  ``failed_idle_timeout_s`` (a workflow whose call failed does not keep a slot it is not using);
* the last call waiting for its admission left (cancelled while queued).

Ends the sidecar infers (issue 12) are *soft*: an agent call of the root session that offered tools
and got an answer without a tool call (its final answer: the turn loop is over), or one whose answer
calls the ``finish`` tool (OpenHands ends a conversation so), and the idle timeouts. A session
that never offered tools (a plain chat client: kv-cache-tester's replayer) has no turn loop to
watch, so it ends on a shorter learned gap of its own (``PLAIN_MAX_IDLE_S`` at most) rather than the
agents' ``idle_timeout_s``; explicit ``X-MARS-Workflow`` / ``vllm_xargs`` workflows keep the
agents' timeout (a replay's recorded tool times can be long). Every end is an event that names its
rule: ``workflow_end`` (``finish_route``, ``last_step``, ``one_call``, ``backend_failed``) or
``workflow_end_inferred`` (``final_answer``, ``finish_tool``, ``idle_timeout``,
``idle_timeout_no_tools``, ``failed_idle_timeout``, ``fair_share``). With several API keys
(tenants) each gets a fair share of the admission window: while one below its share waits and the
window is full, a tenant above its share gives up its longest-idle root (:meth:`RootTable.enforce_fair_shares`). The slot is released, but the workflow is remembered (dormant): when the session comes
back it continues as the same workflow, re-offered ahead of new roots with the size it had. The
idle timeout adapts to the observed return gaps (:class:`~vllm_mars.admission.continuity.GapModel`:
a high percentile times a margin, at most ``idle_timeout_s``). Each inferred end and each return
is an event (``workflow_end_inferred`` with its reason, ``workflow_resumed`` with the gap).
A root's footprint is re-estimated from each agent call (its largest prompt so far plus the
controller's learned growth), so a root offered on a short side call is not admitted at a tenth
of its size.

Everything reads time from ``clock``, so the lifecycle can run in virtual time
(:class:`vllm_mars.clock.VirtualClock`), like the controllers and the scheduler.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm_mars.admission.base import AdmissionEvent, PendingRoot
from vllm_mars.admission.continuity import GapModel
from vllm_mars.admission.identity import Identity, SessionTable
from vllm_mars.clock import Clock

logger = logging.getLogger(__name__)

#: the longest a session that never offered tools waits without calls before it ends (s)
PLAIN_MAX_IDLE_S = 60.0
#: a root idle (no call in flight) at least this long may lose its slot to another tenant's fair share
FAIR_IDLE_S = 1.0
#: identity sources that name workflows explicitly (their idle timeout is always the agents')
EXPLICIT_SOURCES = frozenset({"mars", "vllm_xargs"})


class RootState:
    """One root workflow known to the sidecar."""

    __slots__ = ("admitted", "backend", "blocks", "cached", "end_rule", "failed", "first_call", "in_flight",
                 "last_activity", "last_end", "plain", "prompt_max", "returning", "root", "tokens", "tools_seen",
                 "waiter", "waiters")

    def __init__(self, root: str, now: float) -> None:
        self.root = root
        #: the backend it is placed on (opaque here; set when admitted)
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
        #: when its last call ended (None: none has)
        self.last_end: float | None = None
        #: the largest prompt (estimated tokens) of its agent calls so far
        self.prompt_max = 0
        #: a dormant workflow that came back
        self.returning = False
        #: its root session's last agent call ended the turn loop (``final_answer`` / ``finish_tool``):
        #: the rule that ends it once nothing is in flight
        self.end_rule: str | None = None
        #: a session whose calls never offered tools (ends on the shorter plain-session gap)
        self.plain = False
        #: some call of its root session offered tools
        self.tools_seen = False
        #: its root session's first call is in flight (what it finds cached is KV shared with others)
        self.first_call = False
        #: prompt tokens the latest response reported cached (None: the server does not say)
        self.cached: int | None = None


class RootTable:
    """Roots, sessions and turn counters, tied to one controller (see the module docstring)."""

    def __init__(self, controller: Any, clock: Clock, *, idle_timeout_s: float, failed_idle_timeout_s: float,
                 place: Callable[[RootState], Any] | None = None,
                 on_admit: Callable[[RootState], None] | None = None,
                 on_end: Callable[[RootState], None] | None = None,
                 counters: dict[str, int] | None = None, gaps: GapModel | None = None,
                 dormant_capacity: int = 50_000, tenant_of: Callable[[str], str] | None = None) -> None:
        self.controller = controller
        self.clock = clock
        self.idle_timeout_s = idle_timeout_s
        self.failed_idle_timeout_s = failed_idle_timeout_s
        self._place = place
        self._on_admit = on_admit
        self._on_end = on_end
        #: a root's tenant (its API key) when workflows are scoped to several keys: fair shares apply
        self.tenant_of = tenant_of
        self.roots: dict[str, RootState] = {}
        self.sessions = SessionTable()
        self.turns: dict[str, int] = {}
        #: ends by cause (shared with the feeder's counters when it passes its dict)
        self.counters = counters if counters is not None else {}
        for k in ("finished", "idle_finished", "failed_finished"):
            self.counters.setdefault(k, 0)
        #: whether any backend is up; admission pauses while none is (queued roots keep waiting)
        self.live = True
        #: the idle timeout, learned from return gaps
        self.gaps = gaps if gaps is not None else GapModel(max_s=idle_timeout_s, min_s=min(10.0, idle_timeout_s))
        #: the idle timeout of sessions that never offered tools, learned from their own gaps
        self.plain_gaps = GapModel(max_s=min(PLAIN_MAX_IDLE_S, idle_timeout_s), min_s=min(2.0, idle_timeout_s))
        #: softly ended workflows: root -> (ended at, last call end, tokens, largest prompt)
        self.dormant: OrderedDict[str, tuple[float, float | None, int, int]] = OrderedDict()
        self.dormant_capacity = dormant_capacity
        self._events: list[AdmissionEvent] = []
        for k in ("inferred_ends", "resumed"):
            self.counters.setdefault(k, 0)

    def get(self, root: str) -> RootState | None:
        return self.roots.get(root)

    def rebind(self, controller: Any, place: Callable[[RootState], Any] | None) -> None:
        """Feed ``controller`` and place admitted roots by ``place`` from now on (before any root:
        the sidecar switching to per-backend admission)."""
        assert not self.roots, "rebind before the first root"
        self.controller, self._place = controller, place

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
        meta: dict[str, Any] = {"source": ident.source}
        back = self.dormant.pop(ident.root, None)
        if back is not None:  # a softly ended workflow came back: ahead of new roots, with its size
            ended, last_end, tokens, prompt_max = back
            r.returning, r.tokens, r.prompt_max = True, tokens, prompt_max
            gap = None if last_end is None else now - last_end
            if gap is not None:
                self.gaps.observe(gap)  # (call_started does not count it again: last_end is unset)
            meta["returning"] = True
            prefill_tokens = max(prefill_tokens or 0, prompt_max) or prefill_tokens
            self.counters["resumed"] += 1
            self.emit("workflow_resumed", {"workflow": ident.root, "gap_s": None if gap is None else round(gap, 6),
                                            "dormant_s": round(now - ended, 6), "prefill_tokens_est": prefill_tokens})
        root = PendingRoot(ident.root, now, prefill_tokens, meta)
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
    def call_started(self, r: RootState, ident: Identity, agent: bool | None = None) -> int:
        """Count a call in flight; returns its turn number within its session. ``agent``: the call
        offered tools (None: not known; the root then keeps the agents' idle timeout)."""
        if agent:
            r.tools_seen, r.plain = True, False
        elif agent is False and not r.tools_seen and ident.is_root and ident.source not in EXPLICIT_SOURCES:
            r.plain = True  # no call of this session has offered tools so far
        if r.in_flight == 0 and r.last_end is not None:  # how long the client was away (its tool time)
            (self.plain_gaps if r.plain else self.gaps).observe(self.clock.now() - r.last_end)
        r.in_flight += 1
        if ident.is_root:
            r.end_rule = None
        turn = self.turns.get(ident.workflow, 0)
        self.turns[ident.workflow] = turn + 1
        if turn == 0 and ident.is_root and not ident.anonymous and not r.returning:
            r.first_call, r.cached = True, None
        return turn

    def call_ended(self, r: RootState, ident: Identity, ok: bool, final_answer: bool = False,
                   finish_tool: bool = False) -> None:
        """A call of ``r`` ended; ``ok`` False for an error status, a broken upstream or a client
        that went away. Ends the root when the call was its last step or a one-call workflow, and
        softly when it was the root session's final answer (an agent call answered without a tool
        call) or called the ``finish`` tool, and nothing else of the root is in flight."""
        r.in_flight -= 1
        r.last_activity = r.last_end = self.clock.now()
        r.failed = not ok
        if r.first_call and ident.is_root:
            r.first_call = False
            observe = getattr(self.controller, "observe_cached", None)
            if ok and r.cached is not None and observe is not None:
                observe(r.root, r.cached)
        if ident.anonymous:
            self.turns.pop(ident.workflow, None)
        if self.roots.get(ident.root) is r and (ident.anonymous or (ident.last_step and ident.is_root)):
            self.finish(ident.root, rule="one_call" if ident.anonymous else "last_step")
        else:
            if ok and (final_answer or finish_tool) and ident.is_root:
                # a side call still in flight (a title) does not keep the slot
                r.end_rule = "finish_tool" if finish_tool else "final_answer"
            if r.end_rule is not None and r.in_flight == 0 and self.roots.get(ident.root) is r:
                self.soft_end(ident.root, r.end_rule)

    def prompt_seen(self, r: RootState, prompt_tokens: int) -> None:
        """An agent call of ``r`` with this prompt size: re-estimate its footprint when it grew."""
        if prompt_tokens <= r.prompt_max:
            return
        r.prompt_max = prompt_tokens
        update = getattr(self.controller, "update_estimate", None)
        if update is not None:
            blocks = update(r.root, prompt_tokens, self.clock.now())
            if blocks is not None:
                r.blocks = blocks

    # -- ending -----------------------------------------------------------------------------------
    def soft_end(self, root: str, reason: str, **data: Any) -> bool:
        """End ``root`` but remember it: a later call continues it (see the module docstring)."""
        r = self.roots.get(root)
        if r is None or not r.admitted:
            return False
        now = self.clock.now()
        tokens, prompt_max, last_end = r.tokens, r.prompt_max, r.last_end
        turns = self.turns.get(root)
        self.counters["inferred_ends"] += 1
        # the event goes first: ending flushes the event log (on_end)
        gaps = self.plain_gaps if r.plain else self.gaps
        self.emit("workflow_end_inferred", {"workflow": root, "rule": reason, "reason": reason, "turns": turns,
                                            "tokens": tokens or None, "idle_timeout_s": round(gaps.timeout_s(), 3),
                                            "gap_samples": gaps.samples, **data})
        self._finish(root, keep_sessions=True)
        self.dormant[root] = (now, last_end, tokens, prompt_max)
        self.dormant.move_to_end(root)
        while len(self.dormant) > self.dormant_capacity:  # the oldest is forgotten for good
            self._forget(self.dormant.popitem(last=False)[0])
        return True

    def take_events(self) -> list[AdmissionEvent]:
        out, self._events = self._events, []
        return out

    def emit(self, event: str, data: dict[str, Any]) -> None:
        """Record a lifecycle event (drained by :meth:`take_events`)."""
        self._events.append(AdmissionEvent(self.clock.now(), event, data))

    def finish(self, root: str, final_tokens: int | None = None, rule: str = "finish_route") -> bool:
        """End ``root`` (admitted, queued or dormant) by ``rule`` (named in its ``workflow_end``
        event); False when it is not known."""
        if root in self.roots:
            self.emit("workflow_end", {"workflow": root, "rule": rule, "turns": self.turns.get(root)})
        if self._finish(root, final_tokens):
            self.dormant.pop(root, None)
            return True
        if self.dormant.pop(root, None) is None:
            return False
        self._forget(root)
        return True

    def _forget(self, root: str) -> None:
        for session in self.sessions.forget_root(root) | {root}:
            self.turns.pop(session, None)

    def _finish(self, root: str, final_tokens: int | None = None, keep_sessions: bool = False) -> bool:
        r = self.roots.pop(root, None)
        if r is None:
            return False
        if final_tokens is None and r.tokens:
            final_tokens = r.tokens  # with the root session's call count: how much workflows grow per turn
        self.controller.finish(root, self.clock.now(), final_tokens, turns=self.turns.get(root))
        if not keep_sessions:
            for session in self.sessions.forget_root(root):
                self.turns.pop(session, None)
        self.counters["finished"] += 1
        if self._on_end is not None:
            self._on_end(r)
        self.tick()
        return True

    def enforce_fair_shares(self) -> list[str]:
        """Per-tenant fair shares of the admission window (several API keys): while a tenant below
        its share (``limit // tenants with roots``) has a root waiting and the window is full, a
        tenant above its share gives up its longest-idle root (no call in flight for ``FAIR_IDLE_S``;
        a soft end, rule ``fair_share``: it comes back ahead of new roots). One root per starved
        tenant per call (the ticker calls it). Returns the roots ended."""
        if self.tenant_of is None:
            return []
        limit = self.controller.limit() if hasattr(self.controller, "limit") else -1
        if limit <= 0 or self.controller.num_active < limit:
            return []
        admitted: dict[str, list[RootState]] = {}
        waiting: set[str] = set()
        for r in self.roots.values():
            t = self.tenant_of(r.root)
            if r.admitted:
                admitted.setdefault(t, []).append(r)
            else:
                waiting.add(t)
        if not waiting:
            return []
        share = max(1, limit // len(set(admitted) | waiting))
        need = sum(1 for t in waiting if len(admitted.get(t, ())) < share)
        now = self.clock.now()
        out: list[str] = []
        for t, rs in sorted(admitted.items(), key=lambda kv: -len(kv[1])):
            if len(out) >= need or len(rs) <= share:
                break
            idle = sorted((r for r in rs if not r.in_flight and now - r.last_activity >= FAIR_IDLE_S),
                          key=lambda r: r.last_activity)
            for r in idle[: min(len(rs) - share, need - len(out))]:
                self.counters["fair_share_ends"] = self.counters.get("fair_share_ends", 0) + 1
                self.soft_end(r.root, "fair_share", tenant_roots=len(rs), share=share)
                out.append(r.root)
        return out

    def expire(self) -> list[str]:
        """End (softly) admitted roots idle past the learned idle timeout; returns them."""
        now = self.clock.now()
        timeout = self.gaps.timeout_s()
        plain_timeout = self.plain_gaps.timeout_s()
        out = []
        for r in list(self.roots.values()):
            if not r.admitted or r.in_flight:
                continue
            idle = now - r.last_activity
            if idle > (plain_timeout if r.plain else timeout):
                self.counters["idle_finished"] += 1
                reason = "idle_timeout_no_tools" if r.plain else "idle_timeout"
            elif r.failed and idle > self.failed_idle_timeout_s:
                self.counters["failed_finished"] += 1
                reason = "failed_idle_timeout"
            else:
                continue
            out.append(r.root)
            self.soft_end(r.root, reason, idle_s=round(idle, 3))
        return out
