"""The knobs of the ``mars`` policy: every field is a key of ``additional_config["mars"]``.
The ``mars-no-*`` ablations (:mod:`.ablations`) each turn one mechanism switch off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_INF = float("inf")


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
    #: Work-conserving quanta (a quantum binds only while other work competes for the step; beside
    #: a running decode a prefill's chunk extends beyond its quantum only to the prefill tokens a
    #: step's fixed cost is worth, :meth:`~vllm_mars.costmodel.CostModel.free_prefill_tokens`: 0,
    #: so the quanta bind, on the uncalibrated default model) and aging relative to observed turn
    #: times (``aging_turns`` mean turns per level). Off: fixed quanta and ``aging_s``
    #: (``mars-no-scaled-mlfq``).
    scaled_mlfq: bool = True
    #: When the pool cannot keep contexts (the returning turns find, on average, less than
    #: ``evicted_share`` of the prefix their workflow had computed: an EMA over returning turns),
    #: order by the workflow's first arrival and drop the quanta: the MLFQ ranks a turn by the part
    #: of its prompt it expects uncached, which is wrong when the context was evicted, and demotes
    #: the rebuild as if it were new work (``mars-no-evicted-order`` turns it off).
    evicted_order: bool = True
    #: The EMA's threshold for ``evicted_order`` (share of the expected cached prefix found).
    evicted_share: float = 0.5
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
                     "reserve_prefills", "reserve_priced", "evicted_order", "evicted_warmup"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "true or false", getattr(self, name))
        for name, n in (("level_thresholds", 3), ("quanta", 4)):
            v = getattr(self, name)
            if (not isinstance(v, (list, tuple)) or len(v) != n
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
                fail(name, f"a list of {n} positive integers", v)
            object.__setattr__(self, name, tuple(v))
        if list(self.level_thresholds) != sorted(self.level_thresholds):
            fail("level_thresholds", "increasing", self.level_thresholds)
        for name in ("aging_s", "aging_turns", "max_retention_s", "memory_cost_weight", "cold_start_tau_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == _INF:
                fail(name, "a finite number >= 0", v)
        if not (isinstance(self.evicted_share, (int, float)) and not isinstance(self.evicted_share, bool)
                and 0 <= self.evicted_share <= 1):
            fail("evicted_share", "in [0, 1]", self.evicted_share)
        w = self.evicted_ema_weight
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w <= 1):
            fail("evicted_ema_weight", "in (0, 1]", w)
        if not (isinstance(self.min_free_fraction, (int, float)) and 0 <= self.min_free_fraction < 1):
            fail("min_free_fraction", "in [0, 1)", self.min_free_fraction)
        for name in ("min_gap_samples", "gap_window", "gap_max_keys", "reserve_window", "reserve_min_holds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail(name, "an integer >= 1", v)
