"""``infercept`` and ``infercept_swap``: min-waste KV handling at tool interceptions.

Source: InferCept (Abhyankar et al., ICML 2024, arXiv 2402.01869), section 4 (waste model and
min-waste scheduling), section 4.4 (interception-time estimate).

Rule
----
At each *interception* (a call that ends in a tool call: tagged, not its workflow's last step),
with ``C`` the call's context tokens, ``C_other`` the context tokens of the other running calls and
``M`` the KV bytes per token (it cancels)::

    waste_preserve = T_int * C * M
    waste_discard  = T_fwd(C) * (C + C_other) * M        # recompute stalls the whole batch
    waste_swap     = T_load(C) * C * M                   # infercept_swap only (see below)

InferCept re-estimates the interception time every iteration as the time since the call ended
(``T_int = t_now - t_call``), so preserving stays cheapest until the elapsed time reaches the
break-even point ``tau = min(waste_discard, waste_swap) / (C * M)``; past it the KV is released.
We express exactly that as a retention of ``tau`` seconds. On top, the interception time is learned
online (:class:`~vllm_mars.policies.gaps.GapTracker`: the workflow's own return gaps, else those
of the tool it is about to run (else of its previous tool), else all; at least ``min_samples``):
when the learned mean already exceeds ``tau``, the KV is released at once (the paper's "discard
when long"). No oracle.

Order: FCFS by the *original* arrival of the request, i.e. of the workflow's first call: a call
resuming after an interception keeps its workflow's place (InferCept resumes the same sequence),
so later turns of earlier workflows go before new workflows; the victim under KV pressure is the
reverse (the latest-arrived workflow first).

Our choices where the paper is open
-----------------------------------
* ``T_fwd(C) = prefill_s_per_token2 * C**2 + prefill_s_per_token * C + prefill_s_const``
  (defaults: the preview's 0.0002 s/token, linear).
* The tool the ending call is about to run comes from the engine's tool-call parser or the
  client's ``mars_next_tool`` when known, else the tool its previous turn ran (``mars_tool``):
  :func:`~vllm_mars.policies.gaps.gap_tool`; the estimate uses the workflow's history first.
* Under KV pressure the retention with the lowest expected saving
  (``waste_discard - mean_gap * C``) is released first.
* The preview halves the discard waste (``/ 2``); the paper does not, and neither do we.

Swap (``infercept_swap``)
------------------------
It swaps through vLLM's native CPU KV offloading connector: start the engine with
``--kv-offloading-size <GiB>`` (``mars replay|compare|serve --engine-arg kv_offloading_size=<GiB>``,
the sim included, which models the tier: :mod:`vllm_mars.sim.offload`); without a connector the
scheduler refuses to start, and on vLLM's CPU build too (no accelerator memory to swap from).
(vLLM's ``lmcache`` offloading backend needs a separate LMCache server; it is not tested here.)

That connector is not InferCept's synchronous swap, and the waste model follows the connector:
every computed prompt block is copied to the host while the batch runs (swap-out costs no stall),
and a returning call's host blocks are loaded asynchronously (the call waits for its load; the
batch does not). So releasing to the host wastes only the call's own memory during its load,
``waste_swap = T_load(C) * C``, with ``T_load(C) = C x`` the host-to-device seconds per token: the
engine's (the sim's connector knows its link and the model's KV bytes) unless ``swap_s_per_token``
is set, else InferCept's ``solver.py`` constant 4e-5 s/token. Preserving pays only while the
interception is shorter than that load; past it the GPU blocks are freed and the next turn loads
what the host tier still holds (what it evicted is recomputed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_mars.costmodel import CostModel, from_polynomial
from vllm_mars.options import check_nonneg
from vllm_mars.policies.base import CallView, FirstArrivals, Policy, register_policy
from vllm_mars.policies.gaps import GapTracker, gap_tool


def prefill_seconds(cost: CostModel, tokens: int) -> float:
    """T_fwd: the recompute time of ``tokens`` context tokens (one step's overhead plus the rebuild)."""
    if tokens <= 0:
        return 0.0
    return cost.step_overhead_s + cost.rebuild_s(tokens)


def config_cost_model(policy: Policy) -> None:
    """Give ``policy`` its config's ``prefill_s_*`` model: pinned when the fields were set (the
    operator calibrated them), else as the uncalibrated default the engine may replace."""
    cfg = policy.config
    if not hasattr(cfg, "prefill_s_per_token"):
        return
    fields = (cfg.prefill_s_per_token, cfg.prefill_s_per_token2, cfg.prefill_s_const)
    default = fields == (2e-4, 0.0, 0.0)
    policy.set_cost_model(from_polynomial(*fields, source=f"{policy.name} config prefill_s_* fields"
                                          + (" (default, uncalibrated)" if default else ""),
                                          calibrated=not default), pinned=not default)


@dataclass(frozen=True)
class InferceptConfig:
    #: Linear term of T_fwd (seconds per token of recomputed context).
    prefill_s_per_token: float = 0.0002
    #: Quadratic term of T_fwd (seconds per token squared; attention).
    prefill_s_per_token2: float = 0.0
    #: Constant term of T_fwd (seconds).
    prefill_s_const: float = 0.0
    #: Retentions shorter than this are not worth holding (the preview's 0.01 s).
    min_retention_s: float = 0.01
    #: Return gaps needed before the learned mean may discard at once.
    min_samples: int = 3
    #: Return gaps remembered per tool / workflow (GapTracker window).
    gap_window: int = 256
    #: Workflows whose first arrival is remembered for ordering (least recently seen forgotten first).
    max_workflows: int = 65536

    def __post_init__(self) -> None:
        check_nonneg(self, "prefill_s_per_token", "prefill_s_per_token2", "prefill_s_const",
                      "min_retention_s")
        if self.prefill_s_per_token + self.prefill_s_per_token2 + self.prefill_s_const <= 0:
            raise ValueError("the prefill cost model is zero: set prefill_s_per_token > 0")
        for n in ("min_samples", "gap_window", "max_workflows"):
            if getattr(self, n) < 1:
                raise ValueError(f"{n} must be >= 1, got {getattr(self, n)}")


@dataclass(frozen=True)
class Interception:
    """One min-waste decision, in token-seconds (the common factor M dropped)."""

    request_id: str
    context: int
    other: int
    waste_discard: float
    waste_swap: float | None
    expected_gap: float | None
    #: Seconds to preserve (0: release now).
    retain_s: float
    #: "preserve", "discard" or "swap".
    action: str


@register_policy
class InferceptPolicy(Policy):
    """Min-waste preserve/discard at interceptions; FCFS by the workflow's original arrival."""

    name = "infercept"
    Config = InferceptConfig
    retains = True
    orders = True
    uses_cost = True
    swap = False

    def __init__(self, config: Any = None, clock=None) -> None:
        super().__init__(config, clock)
        config_cost_model(self)
        self.gaps = GapTracker(window=self.config.gap_window)
        self.last_decision: Interception | None = None
        self._first_seq = FirstArrivals(self.config.max_workflows)

    # -- bookkeeping ------------------------------------------------------------------------------
    def on_arrival(self, call: CallView) -> None:
        wf = call.workflow
        call.state = self._first_seq.first(wf.workflow, call.seq)
        if wf.tagged:
            self.gaps.call_arrived(wf.workflow, self.clock.now(), wf.tool)

    def on_finished(self, call: CallView, aborted: bool) -> None:
        wf = call.workflow
        if not wf.tagged:
            return
        if aborted or wf.last_step:
            self.gaps.forget(wf.workflow)
            self._first_seq.forget(wf.workflow)
        else:
            self.gaps.call_ended(wf.workflow, self.clock.now(), call.next_tool)

    # -- order ------------------------------------------------------------------------------------
    def waiting_key(self, call: CallView) -> Any:
        return (call.state, call.seq)  # (workflow's first arrival, this call's arrival)

    running_key = waiting_key

    def steady_decodes(self, calls: Sequence[CallView]) -> bool:
        return True  # (workflow's first arrival, seq): fixed keys, no per-step state

    # -- decision ---------------------------------------------------------------------------------
    def expected_gap(self, call: CallView) -> float | None:
        s = self.gaps.samples(tool=gap_tool(call), workflow=call.workflow.workflow,
                              min_samples=self.config.min_samples)
        return s.mean if s is not None else None

    def swap_waste(self, context: int, batch: int) -> float | None:
        return None

    def decide(self, call: CallView) -> Interception:
        cfg = self.config
        c = max(call.num_tokens, 1)
        other = 0
        if self.engine is not None:
            rid = call.request_id
            other = sum(o.num_tokens for o in self.engine.running_calls() if o.request_id != rid)
        batch = c + other
        w_discard = prefill_seconds(self.cost, c) * batch
        w_swap = self.swap_waste(c, batch)
        release = "discard" if w_swap is None or w_discard <= w_swap else "swap"
        w_release = w_discard if release == "discard" else w_swap
        tau = w_release / c  # break-even preservation time
        expected = self.expected_gap(call)
        if (expected is not None and expected * c > w_release) or tau < cfg.min_retention_s:
            retain, action = 0.0, release
        else:
            retain, action = tau, "preserve"
        d = Interception(call.request_id, c, other, w_discard, w_swap, expected, retain, action)
        self.last_decision = d
        return d

    def retention_s(self, call: CallView, num_blocks: int) -> float:
        return self.decide(call).retain_s

    def retention_value(self, call: CallView, num_blocks: int) -> float:
        d = self.last_decision  # decided for this call by retention_s just before
        if d is None or d.request_id != call.request_id:
            d = self.decide(call)
        w = d.waste_discard if d.waste_swap is None else min(d.waste_discard, d.waste_swap)
        return w - (d.expected_gap or 0.0) * d.context


#: InferCept's ``solver.py`` swap time per token, for an engine that does not say its own.
INFERCEPT_SWAP_S_PER_TOKEN = 4e-5


@dataclass(frozen=True)
class InferceptSwapConfig(InferceptConfig):
    #: Seconds per token to load KV from the host (None: the engine's tier, else 4e-5).
    swap_s_per_token: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.swap_s_per_token is not None:
            check_nonneg(self, "swap_s_per_token")


@register_policy
class InferceptSwapPolicy(InferceptPolicy):
    """``infercept`` plus the swap option through the CPU offload tier (waste_swap = T_load(C) * C * M)."""

    name = "infercept_swap"
    Config = InferceptSwapConfig
    swap = True
    needs_kv_connector = True

    def load_s_per_token(self) -> float:
        """Host-to-device seconds per context token: the config's, else the engine connector's
        (``load_seconds_per_token``, the sim's tier), else InferCept's constant."""
        if self.config.swap_s_per_token is not None:
            return self.config.swap_s_per_token
        s = getattr(getattr(self.engine, "connector", None), "load_seconds_per_token", None)
        return INFERCEPT_SWAP_S_PER_TOKEN if s is None else float(s)

    def check_platform(self, platform: str) -> None:
        if platform == "cpu":
            raise ValueError(
                "policy 'infercept_swap' cannot run on the CPU build of vLLM: it swaps KV from "
                "accelerator memory to host memory through vLLM's CPU KV offloading connector "
                "(--kv-offloading-size), and vLLM's CPU build has no CPU-offload connector to swap "
                "to (the KV cache already lives in host memory). Use 'infercept' here, or run "
                "'infercept_swap' on a GPU with --kv-offloading-size set, or in the sim (--backend sim "
                "--engine-arg kv_offloading_size=<GiB>).")

    def swap_waste(self, context: int, batch: int) -> float | None:
        # T_load(C) * C: only the call waits for its asynchronous load (module docstring)
        return self.load_s_per_token() * context * context
