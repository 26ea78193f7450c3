"""T_ideal: a workflow's time alone on an idle engine, from the engine's cost model.

The driver calibrates :class:`~vllm_mars.costmodel.CostModel` on the idle engine at run start
(solo calls, :meth:`CostModel.from_solo_calls`), or it comes from a step-time profile. A call
alone costs ``CostModel.call_s(new_tokens, output_tokens, context)``. On an idle engine with prefix
caching, turn k > 0 only prefills what was appended since turn k-1 (its tool output) plus the last
output token, after the context already cached. The workflow's ideal time is its critical path:
its own chain of calls and tools, and each child starting after its parent's turn (children and
parents overlap as the plan allows).
"""

from __future__ import annotations

from typing import Any

from vllm_mars.costmodel import CostModel

__all__ = ["CostModel", "ideal_time"]


def ideal_time(plan: Any, cost: CostModel) -> float:
    """Critical-path time of ``plan`` (a ``WorkflowPlan``) and its children alone on an idle engine."""
    t = 0.0
    end = 0.0
    children = list(getattr(plan, "children", ()) or ())
    waits: list[float] = []
    context = 0
    for k, turn in enumerate(plan.turns):
        if waits:  # the parent's next turn waits for its sub-agents
            t = max([t, *waits])
            waits = []
        keep = getattr(turn, "keep_tokens", None) if k else None
        if keep is not None:  # a compaction: only the kept head is cached, the summary is new
            new, cached = len(turn.summary_ids) + len(turn.appended_ids), min(keep, context)
        else:
            new = len(plan.initial_ids) if k == 0 else len(turn.appended_ids) + 1
            cached = 0 if k == 0 else max(context - 1, 0)
        t += cost.call_s(new, turn.output_tokens, cached)
        context = cached + new + turn.output_tokens
        for after, child in children:
            if after == k:
                child_end = t + ideal_time(child, cost)
                end = max(end, child_end)
                if getattr(child, "parent_waits", True):
                    waits.append(child_end)
        t += max(turn.tool_s, 0.0)
    return max([t, end, *waits])
