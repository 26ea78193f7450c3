"""Whole-life sizing: the active roots' contexts projected over their remaining turns.

Pure functions over ``items``: one ``(remaining turns, context tokens)`` pair per active root,
sorted by remaining turns, most first. Each context grows by ``growth`` tokens per turn until its
predicted last turn and is freed after it.
"""

from __future__ import annotations

import math

#: (remaining turns, current context tokens) of one root
Item = tuple[float, float]


def pred_turns(turns: object, learned: float) -> float:
    """LLM calls a root makes: its own ``turns`` when it reports them (an int >= 1), else ``learned``."""
    return float(turns) if isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1 else learned


def life_peak(items: list[Item], growth: float) -> float:
    """Peak over the coming turns of the contexts' sum (tokens): the sum peaks just before some
    root ends."""
    peak = base = 0.0
    for n, (rem, ctx) in enumerate(items, 1):
        base += ctx
        peak = max(peak, base + growth * rem * n)
    return peak


def projection(items: list[Item], growth: float) -> list[float]:
    """The projected sum of the contexts at each coming turn k = 1, 2, ... (tokens): the roots with
    at least k turns left, each grown by k turns."""
    if not items:
        return []
    out = [0.0] * math.ceil(items[0][0])
    j = n = 0
    base = 0.0
    for k in range(len(out), 0, -1):
        while j < len(items) and items[j][0] >= k:
            base += items[j][1]
            n += 1
            j += 1
        out[k - 1] = base + growth * k * n
    return out


def marginal_overflow(items: list[Item], grown: list[Item], cap: float, growth: float) -> list[float]:
    """Tokens a candidate adds beyond ``cap`` at each coming turn (``grown`` = ``items`` with the
    candidate)."""
    before, after = projection(items, growth), projection(grown, growth)
    return [max(0.0, a - cap) - max(0.0, (before[k] if k < len(before) else 0.0) - cap)
            for k, a in enumerate(after)]


def pool_keeps(cap: float, items: list[Item], growth: float, keep: int, cand: Item | None = None) -> bool:
    """The pool (``cap`` tokens) holds ``keep`` of the contexts the roots will have: the mean of the
    roots' (and the candidate's) contexts, each grown by its remaining turns. True when there are none."""
    ctx = [c + growth * rem for rem, c in items] + ([cand[1] + growth * cand[0]] if cand is not None else [])
    return not ctx or cap >= keep * (sum(ctx) / len(ctx))


def later_items(items: list[Item], turns: float, growth: float) -> list[Item]:
    """``items`` once ``turns`` more turns have passed: the roots still active, each grown by them
    (in ``items`` order)."""
    return [(x - turns, ctx + growth * turns) for x, ctx in items if x > turns]
