"""``mars``: the agent-centric in-engine scheduler (SPEC section 2), and its ablations.

Mechanisms, each switched by one config field (the ablation policies flip them):

* **MLFQ** (``mlfq``): levels 0 (highest) .. 3. A call enters by its *uncached* remaining prefill
  (``level_thresholds``); each level has a per-step prefill quantum (``quanta``); a prefill that
  spends its whole quantum with work left is demoted one level. Running calls are served in
  (level, decodes first, arrival) order, waiting calls in (level, preempted first, arrival) order.
* **Decode promotion** (``promote_decodes``): a call that is generating is at level 0.
* **Preempted first** (``preempted_first``) among the waiting calls of their level.
* **Aging** (``aging_s``): the effective level drops by one per ``aging_s`` since the call was last
  given tokens, so a waiting call reaches level 0 within ``3 * aging_s``.
* **Elastic prefill** (``elastic``): a prefill chunk that does not fit the free KV blocks shrinks to
  what fits (down to one block) instead of making vLLM preempt somebody.
* **Priority-aware reclamation** (``priority_reclaim``): vLLM preempts our largest ``victim_key``
  first: prefills before decodes, then the lowest level, then the largest KV holder, then the
  latest arrival. vLLM stops preempting as soon as the allocation fits; the scheduler releases
  retained KV (lowest ``retention_value`` first) before any preemption.
* **Adaptive retention** (``retention``): a finished, non-final turn keeps its KV for the tau that
  maximises ``P(gap <= tau) * reload_s(context) - tau * memory_cost``, from learned return gaps
  (per workflow, then per tool, then all; :mod:`vllm_mars.policies.gaps`). No retention when free
  blocks are scarce.

Pure decision logic: no vllm or torch import.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_mars.clock import Clock
from vllm_mars.policies.base import CallView, Policy, register_policy
from vllm_mars.policies.gaps import GapSamples, GapTracker

_INF = float("inf")


@dataclass(frozen=True)
class PrefillCostModel:
    """Seconds to (re)compute ``n`` context tokens: ``fixed_s + per_token_s * n + per_token2_s * n^2``.

    Defaults are of the order of a 7-8B model on one datacenter GPU; :meth:`fit` calibrates from
    measured (tokens, seconds) pairs (e.g. prefill timings of the served model).
    """

    fixed_s: float = 0.0
    per_token_s: float = 2e-4
    per_token2_s: float = 0.0

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens + self.per_token2_s * tokens * tokens

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, float]], quadratic: bool = False) -> PrefillCostModel:
        """Least-squares fit to (tokens, seconds) samples; negative coefficients are clipped to 0."""
        pts = [(float(n), float(t)) for n, t in samples]
        if len(pts) < (3 if quadratic else 2):
            raise ValueError(f"need at least {3 if quadratic else 2} (tokens, seconds) samples, got {len(pts)}")
        cols = 3 if quadratic else 2
        # Normal equations of [1, n, n^2] (small system, solved by Gaussian elimination).
        a = [[0.0] * (cols + 1) for _ in range(cols)]
        for n, t in pts:
            row = [1.0, n, n * n][:cols]
            for i in range(cols):
                for j in range(cols):
                    a[i][j] += row[i] * row[j]
                a[i][cols] += row[i] * t
        for i in range(cols):
            p = max(range(i, cols), key=lambda r: abs(a[r][i]))
            a[i], a[p] = a[p], a[i]
            if abs(a[i][i]) < 1e-30:
                raise ValueError("degenerate samples: need at least two distinct token counts")
            for r in range(cols):
                if r != i:
                    f = a[r][i] / a[i][i]
                    for c in range(i, cols + 1):
                        a[r][c] -= f * a[i][c]
        coef = [max(a[i][cols] / a[i][i], 0.0) for i in range(cols)]
        return cls(coef[0], coef[1], coef[2] if quadratic else 0.0)


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
    #: Seconds of not being scheduled per one-level boost; 0 turns aging off.
    aging_s: float = 30.0
    #: Shrink a prefill chunk to the free KV blocks (down to one block) instead of preempting
    #: (``mars-no-elastic`` turns it off).
    elastic: bool = True
    #: Victims in reverse priority: prefills before decodes, lowest level, largest KV, latest.
    #: Off: the reverse of the running order (vLLM's own rule applied to our order).
    priority_reclaim: bool = True
    #: Adaptive KV retention across tool calls (``mars-no-retention`` turns it off).
    retention: bool = True

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
    #: Reload cost model (PrefillCostModel): seconds = fixed + per_token * n + per_token2 * n^2.
    reload_fixed_s: float = 0.0
    reload_per_token_s: float = 2e-4
    reload_per_token2_s: float = 0.0

    def __post_init__(self) -> None:
        def fail(name: str, allowed: str, value: Any) -> None:
            raise ValueError(f"mars config field {name!r} must be {allowed}, got {value!r}")

        for name in ("mlfq", "promote_decodes", "preempted_first", "elastic", "priority_reclaim",
                     "retention", "estimate_cached_prefix"):
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
        for name in ("aging_s", "max_retention_s", "memory_cost_weight", "cold_start_tau_s",
                     "reload_fixed_s", "reload_per_token_s", "reload_per_token2_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == _INF:
                fail(name, "a finite number >= 0", v)
        if not (isinstance(self.min_free_fraction, (int, float)) and 0 <= self.min_free_fraction < 1):
            fail("min_free_fraction", "in [0, 1)", self.min_free_fraction)
        for name in ("min_gap_samples", "gap_window", "gap_max_keys"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail(name, "an integer >= 1", v)

    @property
    def reload_model(self) -> PrefillCostModel:
        return PrefillCostModel(self.reload_fixed_s, self.reload_per_token_s, self.reload_per_token2_s)


class _State:
    """Per-call MLFQ state (kept in ``CallView.state``)."""

    __slots__ = (
        "computed",
        "decoding",
        "feedback",
        "known_prefix",
        "level",
        "preempted",
        "quantum",
        "quantum_level",
        "retention_value",
    )

    def __init__(self, known_prefix: int) -> None:
        self.feedback = 0            # demotion level from spent quanta
        self.preempted = False       # preempted and not yet scheduled again
        self.known_prefix = known_prefix  # tokens probably in the prefix cache (estimate)
        self.computed = 0            # computed tokens after the last step it was scheduled in
        self.level = 0               # effective level computed at this step's ordering
        self.decoding = False        # decoding at this step's ordering
        self.quantum = 0             # cap applied at the last chunk (0: none)
        self.quantum_level = 0
        self.retention_value = 0.0


@register_policy
class MarsPolicy(Policy):
    """Turn-completion MLFQ + elastic prefill + priority reclamation + adaptive retention."""

    name = "mars"
    Config = MarsConfig
    orders = True
    gates = False

    def __init__(self, config: MarsConfig | None = None, clock: Clock | None = None) -> None:
        super().__init__(config, clock)
        cfg: MarsConfig = self.config
        # Seam flags per instance, so the ablations cost nothing for the mechanisms they drop.
        self.caps_chunks = cfg.mlfq or cfg.elastic
        self.tracks_service = cfg.mlfq
        self.custom_victims = cfg.priority_reclaim
        self.retains = cfg.retention
        self.gaps = GapTracker(cfg.gap_window, cfg.gap_max_keys)
        self.reload = cfg.reload_model
        self._thresholds = cfg.level_thresholds
        self._quanta = cfg.quanta
        self._max_level = len(cfg.quanta) - 1
        self._aging = cfg.aging_s if cfg.mlfq and cfg.aging_s > 0 else 0.0
        self._promote = cfg.promote_decodes
        # workflow -> context tokens of its last finished call (bounded LRU)
        self._context: OrderedDict[str, int] = OrderedDict()

    # -- calibration hook -------------------------------------------------------------------------
    def calibrate_reload(self, samples: Iterable[tuple[int, float]], quadratic: bool = False) -> PrefillCostModel:
        """Fit the reload cost model to measured (tokens, prefill seconds) and use it from now on."""
        self.reload = PrefillCostModel.fit(samples, quadratic)
        return self.reload

    # -- bookkeeping --------------------------------------------------------------------------------
    def on_arrival(self, call: CallView) -> None:
        wf = call.workflow
        known = 0
        if self.config.estimate_cached_prefix and wf.tagged:
            known = min(self._context.get(wf.workflow, 0), call.num_prompt_tokens)
        call.state = _State(known)
        if wf.tagged:
            self.gaps.call_arrived(wf.workflow, self.clock.now(), wf.tool)

    def on_scheduled(self, call: CallView, num_tokens: int) -> None:
        st: _State = call.state
        st.preempted = False
        st.computed = call._req.num_computed_tokens
        if st.quantum and num_tokens >= st.quantum and call.remaining_prefill > 0:
            st.feedback = min(st.quantum_level + 1, self._max_level)
        st.quantum = 0

    def on_preempted(self, call: CallView) -> None:
        st: _State = call.state
        st.preempted = True
        # Its computed prefix was just freed to the prefix cache; it probably comes back as a hit.
        # (vLLM has already reset num_computed_tokens here: use what the last step recorded.)
        st.known_prefix = max(st.known_prefix, min(st.computed, call.num_tokens - 1))

    def on_finished(self, call: CallView, aborted: bool) -> None:
        wf = call.workflow
        if not wf.tagged:
            return
        key = wf.workflow
        if aborted or wf.last_step:
            self._context.pop(key, None)
            self.gaps.forget(key)
            return
        self._context[key] = call.num_tokens
        self._context.move_to_end(key)
        if len(self._context) > self.config.gap_max_keys:
            self._context.popitem(last=False)
        self.gaps.call_ended(key, self.clock.now())

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
            return call.seq
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
        lvl = self.level(call, self.clock.now())
        st.level = lvl
        return (lvl, first, call.seq)

    def victim_key(self, call: CallView) -> Any:
        # Largest first: prefills before decodes, lowest level, largest KV, latest arrival.
        # ``state`` was filled by running_key in this step's ordering pass.
        st: _State = call.state
        return (0 if st.decoding else 1, st.level, call._req.num_computed_tokens, call.seq)

    def chunk_tokens(self, call: CallView, num_computed: int, num_new: int) -> int:
        n = num_new
        cfg = self.config
        st: _State = call.state
        if cfg.mlfq:
            # The quantum of the level used in this step's order (waiting calls: computed now,
            # since the order key may predate this step's prefix-cache lookup).
            lvl = st.level if call.is_running else self.level(call, self.clock.now())
            q = min(self._quanta[lvl], self.engine.token_budget)
            if n >= q:
                n = q
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

    # -- retention ----------------------------------------------------------------------------------
    def _gap_samples(self, call: CallView) -> GapSamples | None:
        wf = call.workflow
        return self.gaps.samples(tool=wf.tool, workflow=wf.workflow, min_samples=self.config.min_gap_samples)

    def choose_retention(self, call: CallView, num_blocks: int) -> tuple[float, float]:
        """(tau seconds, expected net value seconds) for keeping ``num_blocks`` of ``call``."""
        cfg = self.config
        engine = self.engine
        total = max(engine.num_blocks, 1)
        # Once released, this call's blocks would be free (evictable) again.
        free_after = engine.free_blocks() + num_blocks
        if (free_after - num_blocks) / total < cfg.min_free_fraction:
            return 0.0, 0.0
        reload_s = self.reload.seconds(call.num_tokens)
        # Memory cost per second held: the share of the pool held, scaled by pressure (used over
        # free once this call's blocks are released): ~0 on an idle engine, steep near full.
        free_frac = free_after / total
        cost_per_s = cfg.memory_cost_weight * (num_blocks / total) * (1.0 - min(free_frac, 1.0)) / free_frac
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
