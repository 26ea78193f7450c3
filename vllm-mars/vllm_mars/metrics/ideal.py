"""T_ideal: a workflow's time alone on an idle engine, from a calibrated cost model.

The driver calibrates the model on the idle engine at run start (solo calls of two prompt lengths
and two output lengths, best of ``repeats``): ``call_s = overhead + prefill_s_per_token * new_tokens
+ decode_s_per_token * (output_tokens - 1)``. On an idle engine with prefix caching, turn k > 0
only prefills what was appended since turn k-1 (its tool output) plus the last output token.
The workflow's ideal time is its critical path: its own chain of calls and tools, and each child
starting after its parent's turn (children and parents overlap as the plan allows).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CostModel:
    """Solo-call latency model of one engine (seconds)."""

    #: Fixed cost of a call (scheduling, the first step's overhead).
    call_overhead_s: float
    #: Prefill cost per new (uncached) prompt token.
    prefill_s_per_token: float
    #: Decode cost per output token after the first, at batch size 1.
    decode_s_per_token: float
    #: Where the numbers came from.
    source: str = "calibrated"

    def call_s(self, new_prompt_tokens: int, output_tokens: int) -> float:
        return (self.call_overhead_s + self.prefill_s_per_token * max(new_prompt_tokens, 0)
                + self.decode_s_per_token * max(output_tokens - 1, 0))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def fit(cls, short: tuple[int, float], long: tuple[int, float], long_decode: tuple[int, float],
            source: str = "calibrated") -> CostModel:
        """From solo latencies: (prompt P1, t(P1, 1 token)), (P2, t(P2, 1)), (outputs N, t(P2, N))."""
        (p1, t1), (p2, t2), (n, t3) = short, long, long_decode
        if p2 <= p1 or n <= 1:
            raise ValueError("CostModel.fit needs P2 > P1 and N > 1")
        a = max((t2 - t1) / (p2 - p1), 0.0)
        c = max(t1 - a * p1, 0.0)
        b = max((t3 - t2) / (n - 1), 0.0)
        return cls(c, a, b, source)


def ideal_time(plan: Any, cost: CostModel) -> float:
    """Critical-path time of ``plan`` (a ``WorkflowPlan``) and its children alone on an idle engine."""
    t = 0.0
    end = 0.0
    children = list(getattr(plan, "children", ()) or ())
    waits: list[float] = []
    for k, turn in enumerate(plan.turns):
        if waits:  # the parent's next turn waits for its sub-agents
            t = max([t, *waits])
            waits = []
        new = len(plan.initial_ids) if k == 0 else len(turn.appended_ids) + 1
        t += cost.call_s(new, turn.output_tokens)
        for after, child in children:
            if after == k:
                child_end = t + ideal_time(child, cost)
                end = max(end, child_end)
                if getattr(child, "parent_waits", True):
                    waits.append(child_end)
        t += max(turn.tool_s, 0.0)
    return max([t, end, *waits])
