"""``continuum`` and ``continuum_dy``: program-level FCFS with time-to-live KV pins across tool calls.

Sources: Continuum (Li et al., arXiv 2511.02230), section 4 (TTL pinning, the utility model,
program-level FCFS); ``continuum`` follows the released prototype (vllm-continuum,
``estimate_with_func.py``: ``FIXED_THRESHOLD_CONTINUUM = 2.0``), ``continuum_dy`` the paper's
dynamic TTL.

Shared rule
-----------
* Order: program-level FCFS. Waiting calls rank by ``(not preempted, not pinned, program arrival,
  call arrival)``: preempted calls first, then calls whose workflow holds a pin, then later turns
  of earlier programs before new programs. Running calls rank by ``(program arrival, call
  arrival)``; the victim under KV pressure is the reverse: the latest-arrived program first.
  The program is the root workflow (``mars_root``).
* Pin: when a call ends in a tool call (tagged, not last step), keep its KV referenced for TTL
  seconds (the engine's retention seam). Unpinned when the workflow's next call is scheduled, on
  expiry, on abort, and first under allocation pressure, latest-arrived program first.
* A lone request that cannot allocate never crashes: the engine releases pins first and otherwise
  lets vLLM preempt the request itself (the preview raised IndexError there).

``continuum`` TTL: ``pin_s`` (2.0 s) when the tool's running-mean duration is <= ``max_tool_mean_s``
(2.0 s), else 0. A tool never seen counts as mean 0 (pinned), as in the prototype.

``continuum_dy`` TTL::

    tau* = argmax_{tau in {0} U gaps} P(gap <= tau) * (T * eta + reload(C)) - tau

``gaps`` = observed return gaps of the tool when it has ``min_samples`` (100), else all gaps;
``T`` = mean of the last ``queue_delay_window`` preemption-to-readmission delays (0 before any);
``eta`` = memoryfulness, ``-corr(k, N - k)`` over the calls of completed workflows (k calls done
when a call arrives, N calls in all), ``default_eta`` (1.0) until two samples; ``reload(C)`` =
prefill time of the call's context from the cost model. Cold start: ``cold_start_s`` (2.0 s) while
fewer than ``min_samples`` gaps have been observed in all.

Our choices where the paper is open
-----------------------------------
* The tool the ending call is about to run: like the prototype, parsed from the output (vLLM's
  tool-call parser, when the engine is given one), else the client's ``mars_next_tool``, else the
  tool its previous turn ran (``mars_tool``): :func:`~vllm_mars.policies.gaps.gap_tool`; without
  any, the workflow's own gaps. Return gaps come from
  :class:`~vllm_mars.policies.gaps.GapTracker` (no oracle).
* Pins expire on time even when the workflow's next call is already waiting (the prototype keeps
  those until scheduled); the engine releases a pin once the returning call is scheduled.
* The prototype prefers non-last-step victims; we use program LIFO only.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_mars.options import check_nonneg
from vllm_mars.policies.base import CallView, FirstArrivals, Policy, register_policy
from vllm_mars.policies.gaps import GapTracker, gap_tool
from vllm_mars.policies.infercept import config_cost_model, prefill_seconds


@dataclass(frozen=True)
class ContinuumConfig:
    #: Pin duration (seconds) for a tool whose mean is short (the prototype's 2.0 s).
    pin_s: float = 2.0
    #: Pin only when the tool's running-mean return gap is <= this (seconds).
    max_tool_mean_s: float = 2.0
    #: Return gaps remembered per tool / workflow.
    gap_window: int = 256
    #: Programs (root workflows) remembered for program-level FCFS.
    max_programs: int = 65536

    def __post_init__(self) -> None:
        check_nonneg(self, "pin_s", "max_tool_mean_s")
        if self.gap_window < 1 or self.max_programs < 1:
            raise ValueError(f"gap_window and max_programs must be >= 1, got {self.gap_window}, {self.max_programs}")


class _ContinuumBase(Policy):
    orders = True
    retains = True

    #: Pins shorter than this are ignored (the prototype's 0.01 s).
    MIN_PIN_S = 0.01

    def __init__(self, config: Any = None, clock=None) -> None:
        super().__init__(config, clock)
        config_cost_model(self)
        self.gaps = GapTracker(window=self.config.gap_window)
        self._program_seq = FirstArrivals(self.config.max_programs)
        self._pinned: dict[str, float] = {}  # workflow -> pin expiry (policy's own record)

    # -- bookkeeping ------------------------------------------------------------------------------
    def on_arrival(self, call: CallView) -> None:
        wf = call.workflow
        call.state = self._program_seq.first(wf.root, call.seq)
        if wf.tagged:
            self.gaps.call_arrived(wf.workflow, self.clock.now(), wf.tool)

    def on_finished(self, call: CallView, aborted: bool) -> None:
        wf = call.workflow
        self._pinned.pop(wf.workflow, None)
        if not wf.tagged:
            return
        if aborted or wf.last_step:
            self.gaps.forget(wf.workflow)
        else:
            self.gaps.call_ended(wf.workflow, self.clock.now(), call.next_tool)

    # -- order ------------------------------------------------------------------------------------
    def _pinned_now(self, workflow: str) -> bool:
        exp = self._pinned.get(workflow)
        return exp is not None and exp > self.clock.now()

    def waiting_key(self, call: CallView) -> Any:
        return (call.num_preemptions == 0, not self._pinned_now(call.workflow.workflow), call.state, call.seq)

    def running_key(self, call: CallView) -> Any:
        return (call.state, call.seq)

    def steady_decodes(self, calls: Sequence[CallView]) -> bool:
        return True  # (program's first arrival, seq): fixed keys, no per-step state

    # -- pins -------------------------------------------------------------------------------------
    def ttl_s(self, call: CallView, num_blocks: int) -> float:
        raise NotImplementedError

    def retention_s(self, call: CallView, num_blocks: int) -> float:
        tau = self.ttl_s(call, num_blocks)
        if tau < self.MIN_PIN_S:
            return 0.0
        now = self.clock.now()
        if len(self._pinned) > 4 * self.config.max_programs:
            self._pinned = {w: e for w, e in self._pinned.items() if e > now}
        self._pinned[call.workflow.workflow] = now + tau
        return tau

    def retention_value(self, call: CallView, num_blocks: int) -> float:
        # Lowest value released first under pressure: the latest-arrived program.
        return -float(call.state)


@register_policy
class ContinuumPolicy(_ContinuumBase):
    """vLLM-Continuum as released: fixed 2 s pin for tools whose mean duration is <= 2 s."""

    name = "continuum"
    Config = ContinuumConfig

    def tool_mean(self, call: CallView) -> float:
        """Running mean return gap of the call's tool, else of its workflow; 0 when never seen."""
        wf = call.workflow
        s = self.gaps.tool_samples(gap_tool(call)) or self.gaps.workflow_samples(wf.workflow)
        return s.mean if s else 0.0

    def ttl_s(self, call: CallView, num_blocks: int) -> float:
        return self.config.pin_s if self.tool_mean(call) <= self.config.max_tool_mean_s else 0.0


@dataclass(frozen=True)
class ContinuumDyConfig:
    #: TTL while fewer than ``min_samples`` return gaps have been observed in all (seconds).
    cold_start_s: float = 2.0
    #: Gaps needed before the utility model is used (globally) and before a tool's own gaps are.
    min_samples: int = 100
    #: Preemption-to-readmission delays averaged for T.
    queue_delay_window: int = 200
    #: Memoryfulness until two completed workflows have been seen.
    default_eta: float = 1.0
    #: reload(C) cost model: linear term (seconds per token; the preview's default).
    prefill_s_per_token: float = 0.0002
    #: reload(C) cost model: quadratic term (seconds per token squared).
    prefill_s_per_token2: float = 0.0
    #: reload(C) cost model: constant term (seconds).
    prefill_s_const: float = 0.0
    #: Return gaps remembered per tool / workflow and in the global pool.
    gap_window: int = 1024
    #: Programs (root workflows) remembered for program-level FCFS.
    max_programs: int = 65536
    #: Workflows whose call counts are tracked for eta (least recently seen forgotten first).
    max_workflows: int = 65536

    def __post_init__(self) -> None:
        check_nonneg(self, "cold_start_s", "prefill_s_per_token", "prefill_s_per_token2", "prefill_s_const")
        for n in ("min_samples", "queue_delay_window", "gap_window", "max_programs", "max_workflows"):
            if getattr(self, n) < 1:
                raise ValueError(f"{n} must be >= 1, got {getattr(self, n)}")
        if not -1.0 <= self.default_eta <= 1.0:
            raise ValueError(f"default_eta must be in [-1, 1], got {self.default_eta}")
        if self.gap_window < self.min_samples:
            raise ValueError(f"gap_window ({self.gap_window}) must be >= min_samples ({self.min_samples})")


class _Eta:
    """Running Pearson sums over (k, N - k) pairs of completed workflows: O(1) memory."""

    __slots__ = ("n", "sx", "sxx", "sxy", "sy", "syy")

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.syy = self.sxy = 0.0

    def add_workflow(self, total: int) -> None:
        if total < 1:
            return
        n = total
        s1 = n * (n - 1) / 2  # sum k, k = 0..n-1
        s2 = (n - 1) * n * (2 * n - 1) / 6  # sum k^2
        self.n += n
        self.sx += s1
        self.sy += n * n - s1  # sum (n - k)
        self.sxx += s2
        self.syy += n * n * n - 2 * n * s1 + s2
        self.sxy += n * s1 - s2

    def value(self, default: float) -> float:
        if self.n < 2:
            return default
        vx = self.n * self.sxx - self.sx * self.sx
        vy = self.n * self.syy - self.sy * self.sy
        if vx <= 1e-9 or vy <= 1e-9:
            return default
        return -(self.n * self.sxy - self.sx * self.sy) / math.sqrt(vx * vy)


@register_policy
class ContinuumDyPolicy(_ContinuumBase):
    """Continuum's dynamic TTL from the utility over observed return gaps."""

    name = "continuum_dy"
    uses_cost = True
    Config = ContinuumDyConfig

    def __init__(self, config: Any = None, clock=None) -> None:
        super().__init__(config, clock)
        self._delays: deque[float] = deque(maxlen=self.config.queue_delay_window)
        self._preempted_at: dict[str, float] = {}
        self._calls_done: OrderedDict[str, int] = OrderedDict()
        self._eta = _Eta()

    def on_arrival(self, call: CallView) -> None:
        super().on_arrival(call)
        wf = call.workflow.workflow
        self._calls_done[wf] = self._calls_done.get(wf, 0) + 1
        self._calls_done.move_to_end(wf)
        if len(self._calls_done) > self.config.max_workflows:
            self._calls_done.popitem(last=False)

    def on_preempted(self, call: CallView) -> None:
        self._preempted_at[call.request_id] = self.clock.now()

    def steady_decodes(self, calls: Sequence[CallView]) -> bool:
        # a readmitted call's delay sample is taken at its first ordering, then the keys are fixed
        pre = self._preempted_at
        return not pre or not any(c.request_id in pre for c in calls)

    def running_key(self, call: CallView) -> Any:
        if self._preempted_at:
            t = self._preempted_at.pop(call.request_id, None)
            if t is not None:  # readmitted: the delay is a sample of T
                self._delays.append(max(call.last_scheduled - t, 0.0))
        return (call.state, call.seq)

    def on_finished(self, call: CallView, aborted: bool) -> None:
        super().on_finished(call, aborted)
        self._preempted_at.pop(call.request_id, None)
        wf = call.workflow
        if wf.last_step and not aborted:
            total = self._calls_done.pop(wf.workflow, 0)
            if wf.tagged:
                self._eta.add_workflow(total)
        elif aborted:
            self._calls_done.pop(wf.workflow, None)

    # -- the utility model ------------------------------------------------------------------------
    @property
    def queue_delay_s(self) -> float:
        return sum(self._delays) / len(self._delays) if self._delays else 0.0

    @property
    def eta(self) -> float:
        return self._eta.value(self.config.default_eta)

    def ttl_s(self, call: CallView, num_blocks: int) -> float:
        cfg = self.config
        everything = self.gaps.all_samples()
        if len(everything) < cfg.min_samples:
            return cfg.cold_start_s
        own = self.gaps.tool_samples(gap_tool(call))
        records = own if own is not None and len(own) >= cfg.min_samples else everything
        reload = prefill_seconds(self.cost, call.num_tokens)
        base = self.queue_delay_s * self.eta + reload
        if base <= 0:
            return 0.0
        return best_tau(records.values(), base)


def best_tau(sorted_gaps: list[float], base: float) -> float:
    """argmax over tau in {0} U gaps of P(gap <= tau) * base - tau (0 when nothing beats 0)."""
    n = len(sorted_gaps)
    best_tau_s, best_u = 0.0, 0.0
    i = 0
    while i < n:
        v = sorted_gaps[i]
        j = i
        while j + 1 < n and sorted_gaps[j + 1] == v:
            j += 1
        u = (j + 1) / n * base - v
        if u > best_u:
            best_tau_s, best_u = v, u
        i = j + 1
    return best_tau_s
