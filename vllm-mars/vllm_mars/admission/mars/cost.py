"""The cost rule: a root that does not fit goes in when the rebuilds its overflow is expected to
cause cost less than holding it.

* **Rebuild cost** (call-seconds): the overflow is evicted during tool gaps and rebuilt at the next
  turn, and each rebuild stalls the running batch: ``sum over the coming turns of
  rebuild_s(overflow tokens at that turn) * (1 + running calls)``.
* **Queueing cost**: the wait for the next slot (a root's mean active time over the roots
  active). Where the pool cannot keep the contexts the roots will have (fewer than
  ``window_min`` of them; no active set saves them across tool gaps), the cheapest of waiting
  for the k soonest-ending roots plus the rebuilds still left then (:func:`fit_wait_s`): a root
  whose overflow a slot would not remove is not held for it.

Pure functions; the controller supplies the cost model and its learned state.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from vllm_mars.admission.mars.projection import Item, LifeView
from vllm_mars.costmodel import CostModel


def rebuild_cost_s(cost: CostModel, turns: float, running: int, block_size: int, overflow_blocks: int,
                   per_turn_tokens: list[float] | None = None) -> float:
    """Expected engine-time cost (call-seconds) of admitting a root of ``turns`` LLM calls with
    ``overflow_blocks`` beyond the budget: that much context is rebuilt once per turn, and each
    rebuild stalls the ``running`` calls. With ``per_turn_tokens`` (the projection's marginal
    overflow), turn k rebuilds those tokens on top of the blocks short now."""
    return rebuild_s_total(cost, turns, block_size, overflow_blocks, per_turn_tokens) * (1 + running)


def rebuild_s_total(cost: CostModel, turns: float, block_size: int, overflow_blocks: int,
                    per_turn_tokens: list[float] | None = None, stop: float = math.inf,
                    factor: int = 1) -> float:
    """:func:`rebuild_cost_s` before the stall factor ``1 + running`` (seconds of rebuilds).

    With ``stop``: the sum ends as soon as ``total * factor >= stop`` (the terms are >= 0, so
    the full total would reach it too); the result is then only a lower bound that reaches it."""
    bs = block_size
    if per_turn_tokens is None:
        return turns * cost.rebuild_s(overflow_blocks * bs)
    n = max(math.ceil(turns), len(per_turn_tokens))
    short = overflow_blocks * bs
    total = 0.0
    if short == 0:  # only the projection's overflow: the turns without any add nothing
        rebuild = cost.rebuild_s
        for tok in per_turn_tokens:
            if tok > 0:
                total += rebuild(math.ceil(tok))
                if total * factor >= stop:
                    return total
        return total
    for k in range(n):
        tok = (short if k < turns else 0) + (per_turn_tokens[k] if k < len(per_turn_tokens) else 0.0)
        if tok > 0:
            total += cost.rebuild_s(math.ceil(tok))
            if total * factor >= stop:
                return total
    return total


def fit_wait_s(rebuild_s: Callable[[list[float]], float], items: list[Item] | LifeView, cand: Item, cap: float,
               slot_s: float, growth: float, levels: int = 32) -> tuple[float, int]:
    """Queueing cost of holding a candidate ``cand`` until it fits better: ``min over k`` of
    ``k * slot_s`` plus the rebuilds (``rebuild_s(per-turn overflow)``) its overflow would still
    cost once the k soonest-ending active roots have left (the others grown by the turns that
    took). ``items`` may be given as their :class:`LifeView` (then ``growth`` is the view's).
    Returns (cost, k); k = 0: no level checked."""
    view = items if isinstance(items, LifeView) else LifeView(items, growth)
    best, best_k = math.inf, 0
    ends = sorted(view.items)  # soonest-ending first
    checked = 0
    for i, (rem, _) in enumerate(ends):
        if i + 1 < len(ends) and ends[i + 1][0] == rem:
            continue  # roots ending at the same turn leave together
        checked += 1
        if checked > levels:
            break
        k = i + 1
        later = view.later(rem)  # ``items`` order (most turns left first)
        cost = k * slot_s + rebuild_s(later.marginal_overflow(cand, cap))
        if cost < best:
            best, best_k = cost, k
        if not later.items:
            break
    return best, best_k
