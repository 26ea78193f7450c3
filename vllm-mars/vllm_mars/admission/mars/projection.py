"""Whole-life sizing: the active roots' contexts projected over their remaining turns.

Pure functions over ``items``: one ``(remaining turns, context tokens)`` pair per active root,
sorted by remaining turns, most first. Each context grows by ``growth`` tokens per turn until its
predicted last turn and is freed after it.

:class:`LifeView` gives the same numbers for a candidate joining ``items`` incrementally: the
folds over ``items`` are kept, and a candidate recomputes only the part of them it changes (what
comes after its place in the order, and the turns it lives through). It is what the controller
uses at every tick; the functions are its definition (``LifeView.check`` compares the two).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import pairwise
from typing import Any

#: (remaining turns, current context tokens) of one root
Item = tuple[float, float]


def reported_turns(turns: object) -> float | None:
    """A root's own ``turns`` when it reports them (an int >= 1), else None."""
    return float(turns) if isinstance(turns, int) and not isinstance(turns, bool) and turns >= 1 else None


def pred_turns(turns: object, learned: float) -> float:
    """LLM calls a root makes: its own ``turns`` when it reports them (an int >= 1), else ``learned``."""
    own = reported_turns(turns)
    return learned if own is None else own


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


def _descending(item: Item) -> Item:
    return (-item[0], -item[1])


class LifeView:
    """``items`` (sorted as above) with their folds kept, so that a candidate ``cand`` joining them
    costs only what it changes. Every method returns exactly (bit for bit) what the functions
    above return over ``sorted([*items, cand], reverse=True)``: the sums are taken in the same
    order, from the same partial sums.

    * the roots before the candidate's place in the order are summed as without it: their
      partial sums and running peak are kept (``life_peak`` resumes from there);
    * at the turns the candidate does not live through, the projection is that of ``items``, so
      its marginal overflow there is exactly zero; only its own turns are summed again;
    * the folds are taken only as far as a candidate's place asks, and a view made from another
      (``prev``: the previous active set, or the view a candidate joined) starts from its folds
      over the items both start with, when the growth is the same (the same floats).

    A view is immutable: :meth:`grown` is the view with a candidate admitted. ``memo`` is the
    caller's, for results that depend on the view and their own keys only."""

    #: compare every result with the functions above (a test switch; raises AssertionError)
    check = False

    __slots__ = ("_base", "_ctx", "_keeps", "_later", "_peaks", "_prev", "_proj", "_sorted", "growth",
                 "items", "memo")

    def __init__(self, items: list[Item], growth: float, is_sorted: bool = True,
                 prev: LifeView | None = None) -> None:
        self.items = items
        self.growth = growth
        #: ``items`` are in the order the functions expect (else a candidate's results are theirs)
        self._sorted = is_sorted
        self.memo: dict[Any, Any] = {}
        self._base: list[float] | None = None
        self._peaks: list[float] | None = None
        self._proj: list[float] | None = None
        self._ctx: list[float] | None = None
        self._keeps: dict[tuple[float, int], bool] = {}
        self._later: dict[float, LifeView] = {}
        #: a view whose folds this one may start from (over the items both start with)
        self._prev = prev if is_sorted and prev is not None and prev._base is not None else None

    def _fold_to(self, p: int) -> tuple[float, float]:
        """(sum of the first ``p`` contexts, :func:`life_peak` of the first ``p`` items): the folds
        are extended only as far as asked, from where they stopped (or from where a previous
        view's stopped, over the items the two share: ``prev``)."""
        base_l, peak_l = self._base, self._peaks
        if base_l is None:
            base_l, peak_l = self._base, self._peaks = self._reuse()
        assert peak_l is not None
        q = len(base_l) - 1
        if q < p:
            items, g = self.items, self.growth
            base, peak = base_l[q], peak_l[q]
            # the loop of ``life_peak``, from item q
            append_b, append_p = base_l.append, peak_l.append
            for n, (rem, ctx) in enumerate(items[q:p], q + 1):
                base += ctx
                x = base + g * rem * n
                if x > peak:  # noqa: PLR1730 (max(peak, x) without the call: the hot loop)
                    peak = x
                append_b(base)
                append_p(peak)
        return base_l[p], peak_l[p]

    def _reuse(self) -> tuple[list[float], list[float]]:
        """The folds over the items this view shares with ``prev`` from the start (the same
        items, at the same growth: the same floats), else none."""
        prev, self._prev = self._prev, None
        if prev is None or prev._base is None or prev.growth != self.growth:
            return [0.0], [0.0]
        assert prev._peaks is not None
        a, b = prev.items, self.items
        hi = min(len(a), len(b), len(prev._base) - 1)
        lo = 0
        if a[:hi] != b[:hi]:  # binary search for the longest shared start (slice compares run in C)
            hi -= 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid - 1
        return prev._base[:hi + 1], prev._peaks[:hi + 1]

    def position(self, cand: Item) -> int:
        """Where ``cand`` goes in ``items`` (after every item larger than it)."""
        return bisect_left(self.items, (-cand[0], -cand[1]), key=_descending)

    def peak(self) -> float:
        """:func:`life_peak` of ``items``."""
        out = self._fold_to(len(self.items))[1]
        if LifeView.check:
            assert out == life_peak(self.items, self.growth), "LifeView.peak"
        return out

    def peak_with(self, cand: Item) -> float:
        """:func:`life_peak` of ``items`` with ``cand``."""
        p = self.position(cand)
        base, peak = self._fold_to(p)
        g = self.growth
        items = self.items
        base += cand[1]
        peak = max(peak, base + g * cand[0] * (p + 1))
        for n, (rem, ctx) in enumerate(items[p:], p + 2):
            base += ctx
            x = base + g * rem * n
            if x > peak:  # noqa: PLR1730 (max(peak, x) without the call: the hot loop)
                peak = x
        if LifeView.check:
            assert peak == life_peak(sorted([*items, cand], reverse=True), g), "LifeView.peak_with"
        return peak

    def projection(self) -> list[float]:
        """:func:`projection` of ``items`` (do not modify)."""
        if self._proj is None:
            self._proj = projection(self.items, self.growth)
        return self._proj

    def marginal_overflow(self, cand: Item, cap: float) -> list[float]:
        """:func:`marginal_overflow` of ``cand`` over ``items``."""
        items, g = self.items, self.growth
        if not self._sorted:
            return marginal_overflow(items, sorted([*items, cand], reverse=True), cap, g)
        before = self.projection()
        nb = len(before)
        p = self.position(cand)
        rem_c = cand[0]
        top = math.ceil(items[0][0] if p > 0 else rem_c)
        out = [0.0] * top  # the turns past the candidate's own: the projection of ``items``, no change
        kmax = min(top, math.floor(rem_c))
        if kmax >= 1:
            base = self._fold_to(p)[0] + cand[1]
            n = p + 1
            j = p
            m = len(items)
            for k in range(kmax, 0, -1):
                while j < m and items[j][0] >= k:
                    base += items[j][1]
                    n += 1
                    j += 1
                a = base + g * k * n - cap
                b = (before[k - 1] if k - 1 < nb else 0.0) - cap
                # max(0.0, a) - max(0.0, b), without the calls (the hot loop)
                out[k - 1] = (a if a > 0.0 else 0.0) - (b if b > 0.0 else 0.0)  # noqa: FURB136
        if LifeView.check:
            assert out == marginal_overflow(items, sorted([*items, cand], reverse=True), cap, g), \
                "LifeView.marginal_overflow"
        return out

    def grown(self, cand: Item) -> LifeView:
        """The view of ``items`` with ``cand`` admitted."""
        p = self.position(cand)
        items = self.items
        out = LifeView([*items[:p], cand, *items[p:]], self.growth, prev=self)
        if LifeView.check:
            assert out.items == sorted([*items, cand], reverse=True), "LifeView.grown"
        return out

    def pool_keeps(self, cap: float, keep: int, cand: Item | None = None) -> bool:
        """:func:`pool_keeps` of ``items`` (and ``cand``)."""
        g = self.growth
        if self._ctx is None:
            self._ctx = [c + g * rem for rem, c in self.items]
        if cand is None:
            key = (cap, keep)
            out = self._keeps.get(key)
            if out is None:
                ctx = self._ctx
                out = self._keeps[key] = not ctx or cap >= keep * (sum(ctx) / len(ctx))
        else:
            ctx = [*self._ctx, cand[1] + g * cand[0]]
            out = cap >= keep * (sum(ctx) / len(ctx))
        if LifeView.check:
            assert out == pool_keeps(cap, self.items, g, keep, cand), "LifeView.pool_keeps"
        return out

    def later(self, turns: float) -> LifeView:
        """The view of :func:`later_items` of ``items`` after ``turns`` turns."""
        out = self._later.get(turns)
        if out is None:
            later = later_items(self.items, turns, self.growth)
            # (roots a rounding leaves at the same remaining turns may no longer be in order)
            out = self._later[turns] = LifeView(later, self.growth,
                                                all(a >= b for a, b in pairwise(later)))
        return out
