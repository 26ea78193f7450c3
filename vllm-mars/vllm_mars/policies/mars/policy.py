"""The ``mars`` policy's order, quanta, elastic chunks, reclamation and prefill reserve (the
mechanisms: :mod:`vllm_mars.policies.mars`); retention is :class:`.retention.MarsRetention`'s.

Every cost comes from ``self.cost`` (:class:`vllm_mars.costmodel.CostModel`). Pure decision logic:
no vllm or torch import.
"""

from __future__ import annotations

import logging
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_mars.clock import Clock
from vllm_mars.costmodel import CostModel
from vllm_mars.policies.base import CallView, FirstArrivals, register_policy
from vllm_mars.policies.gaps import GapTracker
from vllm_mars.policies.mars.config import MarsConfig
from vllm_mars.policies.mars.retention import MarsRetention

logger = logging.getLogger(__package__)  # vllm_mars.policies.mars

_INF = float("inf")
#: Realized preemption recoveries needed before reserve_priced uses their median.
_MIN_RECOVERIES = 3


class _State:
    """Per-call MLFQ state (kept in ``CallView.state``)."""

    __slots__ = (
        "computed",
        "decoding",
        "feedback",
        "held_since",
        "hit_seen",
        "known_prefix",
        "level",
        "preempted",
        "preempted_at",
        "priced_start",
        "quantum",
        "quantum_level",
        "recover_to",
        "retention_value",
        "wseq",
    )

    def __init__(self, known_prefix: int, wseq: int) -> None:
        self.wseq = wseq             # its workflow's first call (its own seq when not tracked)
        self.hit_seen = False        # its prefix-cache hit has been counted (evicted_order)
        self.feedback = 0            # demotion level from spent quanta
        self.preempted = False       # preempted and not yet scheduled again
        self.known_prefix = known_prefix  # tokens probably in the prefix cache (estimate)
        self.computed = 0            # computed tokens after the last step it was scheduled in
        self.level = 0               # effective level computed at this step's ordering
        self.decoding = False        # decoding at this step's ordering
        self.quantum = 0             # cap applied at the last chunk (0: none)
        self.quantum_level = 0
        self.retention_value = 0.0
        self.held_since = -1.0       # when the reserve first held it (-1: not held)
        self.priced_start = 0        # reserve_priced: 1 let in against the reserve, 2 so started
        self.preempted_at = -1.0     # when it was last preempted (-1: recovered or never)
        self.recover_to = 0          # computed tokens it had then


@register_policy
class MarsPolicy(MarsRetention):
    """Turn-completion MLFQ + elastic prefill + priority reclamation + adaptive retention."""

    name = "mars"
    Config = MarsConfig
    orders = True
    gates = False
    uses_cost = True

    def __init__(self, config: MarsConfig | None = None, clock: Clock | None = None) -> None:
        super().__init__(config, clock)
        cfg: MarsConfig = self.config
        # Seam flags per instance, so the ablations cost nothing for the mechanisms they drop.
        self.caps_chunks = cfg.mlfq or cfg.elastic
        self.tracks_service = cfg.mlfq
        self.custom_victims = cfg.priority_reclaim
        self.retains = cfg.retention
        self.gates = cfg.reserve_prefills
        self.gaps = GapTracker(cfg.gap_window, cfg.gap_max_keys)
        self._thresholds = cfg.level_thresholds
        self._quanta = cfg.quanta
        self._max_level = len(cfg.quanta) - 1
        self._aging = cfg.aging_s if cfg.mlfq and cfg.aging_s > 0 else 0.0
        self._scaled = cfg.mlfq and cfg.scaled_mlfq
        self._turn_ema = 0.0  # observed mean turn time (call arrival to finish), seconds
        self._step_demand: int | None = None  # other work's tokens this step (lazy, see chunk_tokens)
        self._step_decodes: int | None = None  # running calls decoding this step (lazy, chunk_tokens)
        self._promote = cfg.promote_decodes
        # workflow -> context tokens of its last finished call (bounded LRU)
        self._context: OrderedDict[str, int] = OrderedDict()
        # workflow -> seq of its first call (evicted_order; bounded LRU)
        self._first_seq = FirstArrivals(cfg.gap_max_keys)
        # evicted_order: EMA of the share of a returning turn's expected cached prefix it found
        self._kept_ema = 1.0
        self._kept_n = 0  # returning turns in it
        self._evicted = False
        # reserve_priced: the last held calls' waits (seconds), and how often pricing started one
        self._holds: deque[float] = deque(maxlen=cfg.reserve_window)
        # the last preemptions' recovery times (preempted until its KV is recomputed)
        self._recoveries: deque[float] = deque(maxlen=cfg.reserve_window)
        self._priced_starts = 0
        self._priced_preemptions = 0  # preemptions while a priced start was running
        self._priced_running: set[CallView] = set()

    # -- calibration hook -------------------------------------------------------------------------
    def calibrate_reload(self, samples: Iterable[tuple[int, float]], quadratic: bool = False) -> CostModel:
        """Fit the cost model to measured (tokens, prefill seconds) and use it from now on."""
        self.set_cost_model(CostModel.fit_prefill(samples, quadratic))
        return self.cost

    def begin_step(self) -> None:
        self._step_demand = None
        self._step_decodes = None

    def state(self) -> dict[str, Any]:
        """The evicted order's reading (the EMA of the share of their expected cached prefix the
        returning turns found, over how many, whether the pool is seen as not keeping contexts) and,
        with ``reserve_priced``, what the priced reserve has learned (median hold and preemption
        recovery, starts it let in against the reserve and the preemptions seen while they ran)."""
        out = {"kept_share_ema": round(self._kept_ema, 4), "returning_turns": self._kept_n,
               "evicted": self._evicted}
        if self.config.reserve_priced:
            out["reserve_hold_median_s"] = round(statistics.median(self._holds), 4) if self._holds else None
            out["reserve_recovery_median_s"] = (round(statistics.median(self._recoveries), 4)
                                                if self._recoveries else None)
            out["reserve_priced_starts"] = self._priced_starts
            out["reserve_priced_preemptions"] = self._priced_preemptions
        return out

    # -- bookkeeping --------------------------------------------------------------------------------
    def on_arrival(self, call: CallView) -> None:
        wf = call.workflow
        known = 0
        if self.config.estimate_cached_prefix and wf.tagged:
            known = min(self._context.get(wf.workflow, 0), call.num_prompt_tokens)
        wseq = call.seq
        if self.config.evicted_order and wf.tagged:
            wseq = self._first_seq.first(wf.workflow, call.seq)
        call.state = _State(known, wseq)
        if wf.tagged:
            self.gaps.call_arrived(wf.workflow, self.clock.now(), wf.tool)

    def on_scheduled(self, call: CallView, num_tokens: int) -> None:
        st: _State = call.state
        st.preempted = False
        st.computed = call._req.num_computed_tokens
        if st.held_since >= 0:
            self._holds.append(self.clock.now() - st.held_since)
            st.held_since = -1.0
        if st.preempted_at >= 0 and st.computed + num_tokens >= st.recover_to:
            self._recoveries.append(self.clock.now() - st.preempted_at)
            st.preempted_at = -1.0
        if st.priced_start == 1:
            st.priced_start = 2
            self._priced_starts += 1
            self._priced_running.add(call)
        if not st.hit_seen and self.config.evicted_order:
            st.hit_seen = True
            known = st.known_prefix
            if known > 0 and call.cached_tokens >= 0:
                w = self.config.evicted_ema_weight
                self._kept_n += 1
                if self.config.evicted_warmup:
                    w = max(w, 1.0 / (self._kept_n + 1))
                self._kept_ema = (1 - w) * self._kept_ema + w * min(call.cached_tokens / known, 1.0)
                evicted = self._kept_ema < self.config.evicted_share
                if evicted != self._evicted:
                    logger.info("mars: returning turns find %.0f%% of their expected cached prefix (EMA after %d "
                                "turns): %s", 100 * self._kept_ema, self._kept_n,
                                "the pool cannot keep contexts, workflow order without quanta" if evicted
                                else "contexts kept again, MLFQ order")
                self._evicted = evicted
        if st.quantum and num_tokens >= st.quantum and call.remaining_prefill > 0:
            st.feedback = min(st.quantum_level + 1, self._max_level)
        st.quantum = 0

    def steady_decodes(self, calls: Sequence[CallView]) -> bool:
        """A decoding call's order key is fixed (its own seq, or its workflow's first arrival in the
        evicted order) unless MLFQ ranks decodes by level with aging, and ``on_scheduled`` only
        records its computed tokens once nothing is pending: no hold or preemption recovery to
        time, no priced start or first prefix hit to count, no quantum spent."""
        cfg = self.config
        if cfg.mlfq and not (self._evicted or self._promote):
            return False
        first_hit = cfg.evicted_order
        for c in calls:
            st: _State = c.state
            if (st.held_since >= 0 or st.preempted_at >= 0 or st.priced_start == 1 or st.quantum
                    or (first_hit and not st.hit_seen)):
                return False
        return True

    def on_decode_steps(self, call: CallView, steps: int) -> None:
        st: _State = call.state
        st.preempted = False
        st.computed = call._req.num_computed_tokens

    def on_preempted(self, call: CallView) -> None:
        st: _State = call.state
        st.preempted = True
        if self.config.reserve_priced:
            if self._priced_running:
                self._priced_preemptions += 1
                self._priced_running.discard(call)
            if st.preempted_at < 0:
                st.preempted_at, st.recover_to = self.clock.now(), st.computed
        # Its computed prefix was just freed to the prefix cache; it probably comes back as a hit.
        # (vLLM has already reset num_computed_tokens here: use what the last step recorded.)
        st.known_prefix = max(st.known_prefix, min(st.computed, call.num_tokens - 1))

    def on_finished(self, call: CallView, aborted: bool) -> None:
        self._priced_running.discard(call)
        wf = call.workflow
        if not aborted and self._scaled:
            turn = self.clock.now() - call.arrival
            self._turn_ema = turn if self._turn_ema <= 0 else 0.9 * self._turn_ema + 0.1 * turn
            if self._turn_ema > 0 and self.config.aging_s > 0:
                # Never slower than aging_s: under overload turn times grow with the backlog.
                self._aging = min(self.config.aging_s, max(self.config.aging_turns * self._turn_ema, 1e-3))
        if not wf.tagged:
            return
        key = wf.workflow
        if aborted or wf.last_step:
            self._context.pop(key, None)
            self._first_seq.forget(key)
            self.gaps.forget(key)
            return
        self._context[key] = call.num_tokens
        self._context.move_to_end(key)
        if len(self._context) > self.config.gap_max_keys:
            self._context.popitem(last=False)
        self.gaps.call_ended(key, self.clock.now(), call.next_tool)

    # -- levels -------------------------------------------------------------------------------------
    def entry_level(self, uncached_tokens: int) -> int:
        """Level of ``uncached_tokens`` of remaining prefill."""
        for i, bound in enumerate(self._thresholds):
            if uncached_tokens <= bound:
                return i
        return len(self._thresholds)

    def level(self, call: CallView, now: float) -> int:
        """Effective level of ``call`` at ``now`` (0 = highest)."""
        if self.config.promote_decodes and call.is_decoding:
            return 0
        st: _State = call.state
        req = call._req
        done = req.num_computed_tokens
        if st.known_prefix > done:  # noqa: PLR1730 (hot path: no call)
            done = st.known_prefix
        remaining = req.num_tokens - 1 - done
        lvl = st.feedback
        for i, bound in enumerate(self._thresholds):
            if remaining <= bound:
                if i > lvl:  # noqa: PLR1730
                    lvl = i
                break
        else:
            lvl = len(self._thresholds)
        if self._aging and lvl:
            lvl -= int((now - call.last_scheduled) / self._aging)
            if lvl < 0:  # noqa: PLR1730
                lvl = 0
        return lvl

    # -- decisions ----------------------------------------------------------------------------------
    # running_key / victim_key run for every running call on every step: they read the request's
    # counters directly (running calls only) and share this step's level through ``state``.
    def running_key(self, call: CallView) -> Any:
        st: _State = call.state
        req = call._req
        st.decoding = decoding = req.num_computed_tokens >= req.num_tokens - 1
        if not self.config.mlfq:
            return (call.seq,)
        if self._evicted:
            st.level = 0
            return (0, 0, st.wseq, call.seq)
        if decoding and self._promote:
            st.level = 0
            return (0, 0, call.seq)
        st.level = lvl = self.level(call, self.clock.now())
        return (lvl, 0 if decoding else 1, call.seq)

    def waiting_key(self, call: CallView) -> Any:
        st: _State = call.state
        first = 0 if (st.preempted and self.config.preempted_first) else 1
        if not self.config.mlfq:
            return (first, call.seq)
        if self._evicted:
            st.level = 0
            return (0, first, st.wseq, call.seq)
        lvl = self.level(call, self.clock.now())
        st.level = lvl
        return (lvl, first, call.seq)

    def victim_key(self, call: CallView) -> Any:
        # Largest first. ``state`` was filled by running_key in this step's ordering pass.
        st: _State = call.state
        if self.config.cost_reclaim:
            # Cheapest to rebuild first (the computed KV it loses, priced by the cost model), then
            # the lowest level, the latest arrival. vLLM stops preempting as soon as the allocation
            # fits, and with elastic prefill that is almost always one block, which any victim frees.
            return (-self.cost.rebuild_s(call._req.num_computed_tokens), st.level, call.seq)
        # SPEC rule: prefills before decodes, lowest level, largest KV, latest arrival.
        return (0 if st.decoding else 1, st.level, call._req.num_computed_tokens, call.seq)

    def chunk_tokens(self, call: CallView, num_computed: int, num_new: int) -> int:
        n = num_new
        cfg = self.config
        st: _State = call.state
        if cfg.mlfq and not self._evicted:
            # The quantum of the level used in this step's order (waiting calls: computed now,
            # since the order key may predate this step's prefix-cache lookup).
            lvl = st.level if call.is_running else self.level(call, self.clock.now())
            budget = self.engine.token_budget
            q = min(self._quanta[lvl], budget)
            if n >= q:
                # Work-conserving: the quantum binds only against competing work; a prefill may
                # take the step budget that nobody else would use (beside running decodes: only
                # the prefill tokens a step's fixed cost is worth).
                if self._scaled:
                    ext = budget - self._other_demand(call, budget - q)
                    if ext > q and self._running_decodes():
                        ext = min(ext, self.cost.free_prefill_tokens())
                    q = max(q, ext)
                n = min(n, q)
                st.quantum, st.quantum_level = q, lvl
            else:
                st.quantum = 0
        if cfg.elastic:
            engine = self.engine
            bs = engine.block_size
            free = engine.free_blocks()
            if call.is_running:
                # Its last block's unused slots plus the free blocks.
                fit = (-num_computed) % bs + free * bs
            else:
                # A new call: its prefix hits are counted in num_computed; when they sit in the
                # free queue the allocation fails, which for a waiting call preempts nobody.
                fit = free * bs
            if n > fit:
                # Down to what fits; with nothing free, ask for one block, which makes the
                # scheduler reclaim (retained KV first, then vLLM preempts our victim).
                n = fit if fit > 0 else min(n, bs)
                if st.quantum and n < st.quantum:
                    st.quantum = 0  # a chunk cut by memory is no spent quantum
        return n

    def may_start(self, call: CallView) -> bool:
        """Reserve the running prefills' remaining KV before a new call takes blocks."""
        engine = self.engine
        running = engine.running_calls()
        st: _State = call.state
        if st.priced_start == 1:
            st.priced_start = 0  # decided again below (asked again before it was scheduled)
        if not running:
            return True
        bs = engine.block_size
        # Its uncached part (the workflow's previous context is probably still cached or retained).
        need = -(-max(call.remaining_prefill - call.state.known_prefix, 0) // bs)
        for c in running:
            rem = c.remaining_prefill
            if rem > 0:
                need += -(-rem // bs)
        # Retained KV does not count as free: under pressure the value rule chose to keep it, and
        # counting it let calls start that then preempted others (ILR-3 at 0.16 rps in the sim:
        # 52 preemptions and 855 s mean E2E against 19 and 763 s).
        free = engine.free_blocks()
        if need <= free:
            return True
        if (self.config.reserve_priced and len(self._holds) >= self.config.reserve_min_holds
                and st.priced_start < 2):
            hold = statistics.median(self._holds)
            if len(self._recoveries) >= _MIN_RECOVERIES:
                recovery = statistics.median(self._recoveries)
            else:
                # The running calls preempted to free the shortfall, cheapest per block first,
                # rebuilt after waiting like a held call.
                recovery = self._rebuild_to_free(running, need - free) + hold
            risk = (self._priced_preemptions + 1) / (self._priced_starts + 2)
            if risk * recovery < hold:
                st.priced_start = 1  # once: preempted, it waits for the reserve like any other
                return True
        if st.held_since < 0:
            st.held_since = self.clock.now()
        return False

    def _rebuild_to_free(self, running: list[CallView], blocks: int) -> float:
        """Seconds to rebuild the running calls, cheapest per block first, whose KV frees ``blocks``
        (infinite when all of them do not)."""
        bs = self.engine.block_size
        options = []
        for c in running:
            n = c.num_computed_tokens
            if n > 0:
                s, b = self.cost.rebuild_s(n), -(-n // bs)
                options.append((s / b, s, b))
        options.sort()
        cost = 0.0
        for _, s, b in options:
            cost += s
            blocks -= b
            if blocks <= 0:
                return cost
        return _INF

    def _running_decodes(self) -> int:
        """Running calls decoding this step (computed once per step; for the work-conserving quanta)."""
        n = self._step_decodes
        if n is None:
            n = self._step_decodes = sum(1 for c in self.engine.running_calls() if c.remaining_prefill <= 0)
        return n

    def _other_demand(self, call: CallView, limit: int) -> int:
        """Tokens the other running and waiting calls want this step (decodes 1, prefills up to
        their quantum), computed once per step and counted only up to ``limit``."""
        d = self._step_demand
        if d is None:
            d = 0
            engine = self.engine
            for group in (engine.running_calls(), engine.waiting_calls()):
                for c in group:
                    rem = c.remaining_prefill
                    d += min(rem, self._quanta[c.state.level]) if rem > 0 else 1
                    if d > limit + 4096:
                        break
            self._step_demand = d
        own = call.remaining_prefill
        own = min(own, self._quanta[call.state.level]) if own > 0 else 1
        return max(d - own, 0)
