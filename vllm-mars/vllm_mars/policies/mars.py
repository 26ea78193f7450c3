"""``mars``: the agent-centric in-engine scheduler (SPEC section 2), and its ablations.

Mechanisms, each switched by one config field (the ablation policies flip them):

* **MLFQ** (``mlfq``): levels 0 (highest) .. 3. A call enters by its *uncached* remaining prefill
  (``level_thresholds``); each level has a per-step prefill quantum (``quanta``); a prefill that
  spends its whole quantum with work left is demoted one level. Running calls are served in
  (level, decodes first, arrival) order, waiting calls in (level, preempted first, arrival) order.
* **Decode promotion** (``promote_decodes``): a call that is generating is at level 0.
* **Preempted first** (``preempted_first``) among the waiting calls of their level.
* **Aging** (``aging_s``): the effective level drops by one per aging period since the call was last
  given tokens, so a waiting call reaches level 0 within three periods. The period is ``aging_s``,
  or with ``scaled_mlfq`` ``aging_turns`` observed mean turn times (once a turn has finished).
* **Work-conserving quanta** (``scaled_mlfq``): a quantum binds only against competing work; a
  prefill may use the part of the step budget nobody else wants this step, but while another
  running call decodes only up to the prefill tokens a step's fixed cost is worth
  (``quanta_beside_decodes``, priced by the cost model's ``free_prefill_tokens``).
* **Elastic prefill** (``elastic``): a prefill chunk that does not fit the free KV blocks shrinks to
  what fits (down to one block) instead of making vLLM preempt somebody.
* **Reclamation** (``priority_reclaim``): vLLM preempts our largest ``victim_key`` first. With
  ``cost_reclaim``: the call whose computed KV is cheapest to rebuild (``self.cost``), then the
  lowest level, then the latest arrival; without: prefills before decodes, lowest level, largest
  KV. vLLM stops preempting as soon as the allocation fits; the scheduler releases retained KV
  (lowest ``retention_value`` first) before any preemption.
* **Adaptive retention** (``retention``): a finished, non-final turn keeps its KV for the tau that
  maximises ``P(gap <= tau) * saving - tau * cost``, from learned return gaps (per tool: the one
  the turn is about to run when known, else the previous one; then per workflow, then all;
  :mod:`vllm_mars.policies.gaps`). With ``value_retention`` the
  saving is the rebuild time times the calls it stalls and, under pressure, the cost is the waiting
  calls the blocks would serve; without it, a memory cost and no retention when free blocks are
  scarce (``min_free_fraction``).
* **Workflow order** (``workflow_order``, off by default): ties within a level and the victim order
  go by the workflow's first arrival instead of the call's.
* **Order when contexts are evicted** (``evicted_order``, on by default): while returning turns
  find less than ``evicted_share`` of their expected cached prefix (a slow EMA started as a running
  mean), order by the workflow's first arrival with no quanta. A pool that keeps contexts never
  switches; one that holds two or three contexts (H100 + a dense 32B model) switches after a few
  returning turns (``docs/mars.md``).

Every cost comes from ``self.cost`` (:class:`vllm_mars.costmodel.CostModel`), which the scheduler
sets from ``additional_config["mars"]["cost_model"]``, the driver's calibration, or an online fit.

Pure decision logic: no vllm or torch import.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_mars.clock import Clock
from vllm_mars.costmodel import CostModel
from vllm_mars.policies.base import CallView, FirstArrivals, Policy, register_policy
from vllm_mars.policies.gaps import GapSamples, GapTracker, gap_tool

logger = logging.getLogger(__name__)

_INF = float("inf")
#: Realized preemption recoveries needed before reserve_priced uses their median.
_MIN_RECOVERIES = 3
#: MarsConfig.quanta_beside_decodes
_BESIDE_DECODES = ("budget", "free", "quantum")


@dataclass(frozen=True)
class MarsConfig:
    """Parameters of the ``mars`` policy. Every field is a key of ``additional_config["mars"]``."""

    # -- mechanism switches (the ablations) -------------------------------------------------------
    #: Multi-level feedback queues: entry level, quanta, demotion, level order. Off: arrival order,
    #: no quanta (``mars-no-mlfq``).
    mlfq: bool = True
    #: A generating (decoding) call is at level 0.
    promote_decodes: bool = True
    #: Preempted calls go first among the waiting calls of their level.
    preempted_first: bool = True
    #: Seconds of not being scheduled per one-level boost; 0 turns aging off. With ``scaled_mlfq``
    #: only until a turn time has been observed.
    aging_s: float = 30.0
    #: With ``scaled_mlfq``: one-level boost per this many observed mean turn times (call arrival to
    #: finish, EMA), but never slower than ``aging_s``.
    aging_turns: float = 4.0
    #: Shrink a prefill chunk to the free KV blocks (down to one block) instead of preempting
    #: (``mars-no-elastic`` turns it off).
    elastic: bool = True
    #: Victims in reverse priority: prefills before decodes, lowest level, largest KV, latest.
    #: Off: the reverse of the running order (vLLM's own rule applied to our order).
    priority_reclaim: bool = True
    #: Adaptive KV retention across tool calls (``mars-no-retention`` turns it off).
    retention: bool = True
    #: Cost-aware reclamation: the victim is the running call whose computed KV is cheapest to
    #: rebuild (cost model), ties to the lowest level and latest arrival. Off: the SPEC's rule
    #: (prefills before decodes, lowest level, largest KV) (``mars-no-cost-reclaim``).
    cost_reclaim: bool = True
    #: Value-based retention: under pressure a retention is kept only while its expected rebuild
    #: saving exceeds what its blocks would earn serving the waiting calls. Off: a memory cost and
    #: no retention at all below ``min_free_fraction`` free (``mars-no-value-retention``).
    value_retention: bool = True
    #: A waiting call starts only when the free blocks (retained ones not counted) also hold the
    #: remaining prefill of the running calls (vLLM's own gate reserves only the new call's prompt; a demoted long prefill
    #: then finds its blocks taken and someone is preempted) (``mars-no-prefill-reserve``).
    reserve_prefills: bool = True
    #: Keep that reserve while the pool cannot keep contexts (``evicted_order``'s EMA below
    #: ``evicted_share``). Off: there a call may start as vLLM's own gate allows; the contexts are
    #: rebuilt anyway and the cost-aware reclaim preempts the cheapest running call. Off is identical
    #: with admission on the 21 H200 pressure cells, 1.0002x on the 40 H100 top cells, ahead on the
    #: CPU rig (0.992x / 1.268x fcfs against 0.980x / 1.259x) but not on the real CPU engine's fast
    #: regime (0.974x against 0.976x), and 0.991x without admission on the H200 cells (down to
    #: 0.894x at ILR-4): not the default (experiments/reserve_evicted*.toml, benchmark/perf/RESULTS.md).
    reserve_when_evicted: bool = True
    #: Price the reserve: a call the reserve would hold starts anyway when holding costs more than
    #: starting risks, both learned on this engine: holding costs the held calls' typical wait (the
    #: median of the last ``reserve_window`` holds); starting risks a preemption, with the probability
    #: that a call so started saw one (of anyone) before it finished (from 1 of 2 before any) times what a
    #: preemption costs its victim (the median time from preemption to its KV recomputed; before
    #: three of them, the cost model's rebuild of the shortfall plus a hold). No
    #: pricing before ``reserve_min_holds`` holds. Off: the reserve always holds (``mars-no-priced-reserve``).
    reserve_priced: bool = True
    reserve_window: int = 16
    reserve_min_holds: int = 3
    #: Work-conserving quanta (a quantum binds only while other work competes for the step) and
    #: aging relative to observed turn times (``aging_turns`` mean turns per level). Off: fixed
    #: quanta and ``aging_s`` (``mars-no-scaled-mlfq``).
    scaled_mlfq: bool = True
    #: With ``scaled_mlfq``: how far a prefill's chunk extends beyond its quantum while another
    #: running call decodes (each decode rides in the step the chunk lengthens). "free" (the
    #: default): to no more than the prefill tokens a step's fixed cost is worth (the cost model's
    #: :meth:`~vllm_mars.costmodel.CostModel.free_prefill_tokens`: on a GPU the weight read every
    #: step pays, which a MoE's prefill chunk pays for all its experts: about 180 tokens for the
    #: dense Qwen3-32B on an H100, 1400 for Qwen3-Coder-30B-A3B on an H200; 0, so the quanta bind,
    #: on the uncalibrated default model). "budget": to the step budget the other calls do not want
    #: (decodes want one token each). "quantum": none. "free" against "budget": 1.0096x on the H100
    #: grid's 40 top cells, 1.016x on the 21 H200 pressure cells, 0.9997x-1.0011x on the H200
    #: grid's light cells; "quantum" loses 3.5 % on those H200 cells (``experiments/quanta_free*.toml``,
    #: ``quanta_yield*.toml``; docs/mars.md).
    quanta_beside_decodes: str = "free"
    #: Ties within a level (and the victim order) go by the workflow's first arrival instead of the
    #: call's, so later turns of earlier workflows go first and the newest workflow is preempted
    #: first. Off (default): the call's own arrival.
    workflow_order: bool = False
    #: When the pool cannot keep contexts (the returning turns find, on average, less than
    #: ``evicted_share`` of the prefix their workflow had computed: an EMA over returning turns),
    #: order by the workflow's first arrival and drop the quanta, as with ``mlfq`` off and
    #: ``workflow_order`` on: the MLFQ ranks a turn by the part of its prompt it expects uncached,
    #: which is wrong when the context was evicted, and demotes the rebuild as if it were new work.
    evicted_order: bool = True
    #: The EMA's threshold for ``evicted_order`` (share of the expected cached prefix found).
    evicted_share: float = 0.5
    #: A band around ``evicted_share``: the order switches on below ``evicted_share - band`` and back
    #: off above ``evicted_share + band`` (0: both at ``evicted_share``).
    evicted_band: float = 0.0
    #: Weight of a returning turn in that EMA (smaller: a longer memory, slower to switch). 0.1
    #: switched wrongly in a pool that thrashes only for a spell (H200, ILR-4); 0.03 did not.
    evicted_ema_weight: float = 0.03
    #: Start that EMA as a running mean (the n-th returning turn weighs ``max(weight, 1/(n+1))``
    #: after one pseudo-turn that found everything): a pool that cannot keep contexts from the start
    #: is seen after a few returns, a later spell of evictions still moves it at ``evicted_ema_weight``.
    evicted_warmup: bool = True

    # -- MLFQ ---------------------------------------------------------------------------------------
    #: Uncached remaining-prefill tokens bounding levels 0, 1, 2 (above the last: level 3).
    level_thresholds: tuple[int, ...] = (2048, 8192, 32768)
    #: Prefill tokens per step at levels 0..3 (each further capped by the step's token budget).
    quanta: tuple[int, ...] = (2048, 1024, 512, 256)
    #: Estimate a new turn's cached prefix by its workflow's previous context (until vLLM's prefix
    #: lookup gives the real number), so a late turn ranks by its uncached part.
    estimate_cached_prefix: bool = True

    # -- retention ----------------------------------------------------------------------------------
    #: Longest retention, seconds.
    max_retention_s: float = 60.0
    #: No retention while free blocks (after releasing this call's) are below this share of KV.
    min_free_fraction: float = 0.1
    #: Memory cost weight: cost per second held = weight * (blocks / num_blocks) * used / free,
    #: with used/free the pool's shares once this call's blocks are released (seconds of reload
    #: saving forgone per second of retention).
    memory_cost_weight: float = 1.0
    #: Return-gap samples needed before a key's distribution is used (else the next key, else cold).
    min_gap_samples: int = 3
    #: Retention before anything is learned (seconds; 0 = none until gaps are observed).
    cold_start_tau_s: float = 2.0
    #: Return gaps kept per key (tool, workflow) and keys kept (least recently used forgotten).
    gap_window: int = 256
    gap_max_keys: int = 4096

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str, value: Any) -> None:
            raise ValueError(f"mars config field {name!r} must be {allowed}, got {value!r}")

        for name in ("mlfq", "promote_decodes", "preempted_first", "elastic", "priority_reclaim",
                     "retention", "estimate_cached_prefix", "cost_reclaim", "value_retention", "scaled_mlfq",
                     "reserve_prefills", "reserve_when_evicted", "reserve_priced", "workflow_order", "evicted_order", "evicted_warmup"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "true or false", getattr(self, name))
        for name, n in (("level_thresholds", 3), ("quanta", 4)):
            v = getattr(self, name)
            if (not isinstance(v, (list, tuple)) or len(v) != n
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
                fail(name, f"a list of {n} positive integers", v)
            object.__setattr__(self, name, tuple(v))
        if self.quanta_beside_decodes not in _BESIDE_DECODES:
            fail("quanta_beside_decodes", " or ".join(repr(m) for m in _BESIDE_DECODES), self.quanta_beside_decodes)
        if list(self.level_thresholds) != sorted(self.level_thresholds):
            fail("level_thresholds", "increasing", self.level_thresholds)
        for name in ("aging_s", "aging_turns", "max_retention_s", "memory_cost_weight", "cold_start_tau_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == _INF:
                fail(name, "a finite number >= 0", v)
        if not (isinstance(self.evicted_share, (int, float)) and not isinstance(self.evicted_share, bool)
                and 0 <= self.evicted_share <= 1):
            fail("evicted_share", "in [0, 1]", self.evicted_share)
        b = self.evicted_band
        if not (isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 0.5):
            fail("evicted_band", "in [0, 0.5)", b)
        w = self.evicted_ema_weight
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w <= 1):
            fail("evicted_ema_weight", "in (0, 1]", w)
        if not (isinstance(self.min_free_fraction, (int, float)) and 0 <= self.min_free_fraction < 1):
            fail("min_free_fraction", "in [0, 1)", self.min_free_fraction)
        for name in ("min_gap_samples", "gap_window", "gap_max_keys", "reserve_window", "reserve_min_holds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail(name, "an integer >= 1", v)


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
        "tie",
        "wseq",
    )

    def __init__(self, known_prefix: int, wseq: int, tie: int) -> None:
        self.wseq = wseq             # its workflow's first call (its own seq when not tracked)
        self.tie = tie               # order among equals: wseq with workflow_order, else its own seq
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
class MarsPolicy(Policy):
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
        self._step_decodes: int | None = None  # running calls decoding this step (lazy, quanta_beside_decodes)
        self._promote = cfg.promote_decodes
        # workflow -> context tokens of its last finished call (bounded LRU)
        self._context: OrderedDict[str, int] = OrderedDict()
        # workflow -> seq of its first call (workflow_order, evicted_order; bounded LRU)
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
        if (self.config.workflow_order or self.config.evicted_order) and wf.tagged:
            wseq = self._first_seq.first(wf.workflow, call.seq)
        call.state = _State(known, wseq, wseq if self.config.workflow_order else call.seq)
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
                band = self.config.evicted_band
                evicted = self._kept_ema < self.config.evicted_share + (band if self._evicted else -band)
                if evicted != self._evicted:
                    logger.info("mars: returning turns find %.0f%% of their expected cached prefix (EMA after %d "
                                "turns): %s", 100 * self._kept_ema, self._kept_n,
                                "the pool cannot keep contexts, workflow order without quanta" if evicted
                                else "contexts kept again, MLFQ order")
                self._evicted = evicted
        if st.quantum and num_tokens >= st.quantum and call.remaining_prefill > 0:
            st.feedback = min(st.quantum_level + 1, self._max_level)
        st.quantum = 0

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
            return (st.tie, call.seq)
        if self._evicted:
            st.level = 0
            return (0, 0, st.wseq, call.seq)
        if decoding and self._promote:
            st.level = 0
            return (0, 0, st.tie, call.seq)
        st.level = lvl = self.level(call, self.clock.now())
        return (lvl, 0 if decoding else 1, st.tie, call.seq)

    def waiting_key(self, call: CallView) -> Any:
        st: _State = call.state
        first = 0 if (st.preempted and self.config.preempted_first) else 1
        if not self.config.mlfq:
            return (first, st.tie, call.seq)
        if self._evicted:
            st.level = 0
            return (0, first, st.wseq, call.seq)
        lvl = self.level(call, self.clock.now())
        st.level = lvl
        return (lvl, first, st.tie, call.seq)

    def victim_key(self, call: CallView) -> Any:
        # Largest first. ``state`` was filled by running_key in this step's ordering pass.
        st: _State = call.state
        if self.config.cost_reclaim:
            # Cheapest to rebuild first (the computed KV it loses, priced by the cost model), then
            # the lowest level, the latest arrival. vLLM stops preempting as soon as the allocation
            # fits, and with elastic prefill that is almost always one block, which any victim frees.
            return (-self.cost.rebuild_s(call._req.num_computed_tokens), st.level, st.tie, call.seq)
        # SPEC rule: prefills before decodes, lowest level, largest KV, latest arrival.
        return (0 if st.decoding else 1, st.level, call._req.num_computed_tokens, st.tie, call.seq)

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
                # take the step budget that nobody else would use (beside running decodes: as far
                # as quanta_beside_decodes lets it).
                if self._scaled:
                    ext = budget - self._other_demand(call, budget - q)
                    beside = cfg.quanta_beside_decodes
                    if ext > q and beside != "budget" and self._running_decodes():
                        ext = q if beside == "quantum" else min(ext, self.cost.free_prefill_tokens())
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
        if not running or (self._evicted and not self.config.reserve_when_evicted):
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
        """Running calls decoding this step (computed once per step; only for quanta_beside_decodes)."""
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

    # -- retention ----------------------------------------------------------------------------------
    def _gap_samples(self, call: CallView) -> GapSamples | None:
        # The tool about to run (else the previous one), else this workflow's own gaps, else all.
        return self.gaps.samples(tool=gap_tool(call), workflow=call.workflow.workflow,
                                 min_samples=self.config.min_gap_samples, tool_first=True)

    def _pressure(self) -> tuple[int, int, int]:
        """(blocks the waiting calls lack beyond the free ones, waiting calls, running calls), with
        the finishing call's blocks still held."""
        engine = self.engine
        bs = engine.block_size
        waiting = engine.waiting_calls()
        need = sum(-(-c.remaining_prefill // bs) for c in waiting)
        return need - engine.free_blocks(), len(waiting), len(engine.running_calls())

    def choose_retention(self, call: CallView, num_blocks: int) -> tuple[float, float]:
        """(tau seconds, expected net value) for keeping ``num_blocks`` of ``call``.

        Value = ``P(gap <= tau) * saving - tau * cost_per_s``. With ``value_retention`` both are in
        call-seconds: the saving is the rebuild time (cost model) times the calls it stalls (the
        returning call and the running batch); under pressure (waiting calls lack blocks) the cost
        per second is the waiting calls those blocks would serve (their share of the deficit);
        without pressure, the pool-share memory cost. Without ``value_retention``: the rebuild time
        against the memory cost, and no retention below ``min_free_fraction`` free.
        """
        cfg = self.config
        engine = self.engine
        total = max(engine.num_blocks, 1)
        # Once released, this call's blocks would be free (evictable) again.
        free_after = engine.free_blocks() + num_blocks
        reload_s = self.cost.rebuild_s(call.num_tokens)
        # Memory cost per second held: the share of the pool held, scaled by pressure (used over
        # free once this call's blocks are released): ~0 on an idle engine, steep near full.
        free_frac = free_after / total
        cost_per_s = cfg.memory_cost_weight * (num_blocks / total) * (1.0 - min(free_frac, 1.0)) / free_frac
        if cfg.value_retention:
            deficit, n_waiting, n_running = self._pressure()
            reload_s *= 1 + n_running
            if deficit > 0 and n_waiting:
                # Each second held keeps min(blocks, deficit) blocks from the waiting calls.
                cost_per_s = n_waiting * min(num_blocks, deficit) / max(deficit, 1)
        elif (free_after - num_blocks) / total < cfg.min_free_fraction:
            return 0.0, 0.0
        samples = self._gap_samples(call)
        if samples is None:
            tau = min(cfg.cold_start_tau_s, cfg.max_retention_s)
            value = reload_s - tau * cost_per_s
            return (tau, value) if tau > 0 and value > 0 else (0.0, 0.0)
        best_tau, best = 0.0, 0.0
        gaps = samples.values()  # sorted
        n = len(gaps)
        for i, tau in enumerate(gaps):
            if tau > cfg.max_retention_s:
                break
            if i + 1 < n and gaps[i + 1] == tau:
                continue  # P(gap <= tau) counts all equal samples
            v = (i + 1) / n * reload_s - tau * cost_per_s
            if v > best:
                best_tau, best = tau, v
        return best_tau, best

    def retention_s(self, call: CallView, num_blocks: int) -> float:
        if not self.config.retention:
            return 0.0
        tau, value = self.choose_retention(call, num_blocks)
        call.state.retention_value = value
        if tau <= 0:
            return 0.0
        # A small margin over the chosen gap: the return is observed at arrival, then scheduled.
        return tau * 1.05 + 1e-3

    def retention_value(self, call: CallView, num_blocks: int) -> float:
        return call.state.retention_value


def _ablation(name: str, doc: str, **defaults: Any) -> type[MarsPolicy]:
    fields = [(k, type(getattr(MarsConfig, k)), dataclasses.field(default=v)) for k, v in defaults.items()]
    cfg = dataclasses.make_dataclass(f"{name.title().replace('-', '')}Config", fields, bases=(MarsConfig,),
                                     frozen=True)
    cfg.__doc__ = f"``{name}``: MarsConfig with " + ", ".join(f"{k}={v}" for k, v in defaults.items())
    cls = type(name.title().replace("-", "") + "Policy", (MarsPolicy,),
               {"name": name, "Config": cfg, "__doc__": doc, "__module__": __name__})
    return register_policy(cls)


MarsNoMlfqPolicy = _ablation("mars-no-mlfq", "``mars`` with arrival order and no quanta (no MLFQ).",
                             mlfq=False)
MarsNoElasticPolicy = _ablation("mars-no-elastic", "``mars`` without elastic prefill resizing.",
                                elastic=False)
MarsNoRetentionPolicy = _ablation("mars-no-retention", "``mars`` without adaptive KV retention.",
                                  retention=False)
MarsNoCostReclaimPolicy = _ablation("mars-no-cost-reclaim", "``mars`` with the largest-KV victim rule.",
                                    cost_reclaim=False)
MarsNoValueRetentionPolicy = _ablation("mars-no-value-retention",
                                       "``mars`` with the free-share retention cut-off instead of value.",
                                       value_retention=False)
MarsNoPrefillReservePolicy = _ablation("mars-no-prefill-reserve",
                                       "``mars`` without reserving running prefills' KV at admission.",
                                       reserve_prefills=False)
MarsNoPricedReservePolicy = _ablation("mars-no-priced-reserve",
                                      "``mars`` whose prefill reserve holds every call it would hold (not priced).",
                                      reserve_priced=False)
MarsNoScaledMlfqPolicy = _ablation("mars-no-scaled-mlfq", "``mars`` with fixed quanta and fixed aging_s.",
                                   scaled_mlfq=False)
MarsNoEvictedOrderPolicy = _ablation("mars-no-evicted-order",
                                     "``mars`` that keeps the MLFQ order when the pool cannot keep contexts.",
                                     evicted_order=False)
