"""Which queued roots the MARS admission controller admits at a tick, in which order.

* **Missing telemetry**: a fixed window of ``no_telemetry_window`` roots in arrival order, never blind.
* **Cost rule** (``admit = "cost"``, with a cost model): arrival order; a root goes in when its
  footprint fits the budget and (``size = "life"``) its whole life fits the projection, or when the
  rebuilds its overflow would cost are below the cost of holding it (:mod:`.cost`). A root that
  does not qualify is skipped, never blocks the ones behind it.
* **Footprint rule**: light load (no pressure, everything queued fits the slots and the budget):
  arrival order; otherwise smallest footprint first, only what fits. When only long roots (>
  ``long_prefill_tokens``) wait: arrival order within the live budget, at most one per tick while
  earlier admitted roots are active.
* Whatever the rule: if nothing was chosen and nothing is active, the oldest root goes in alone
  (no starvation). A root that came back after a soft end goes before new roots in every order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from itertools import islice
from typing import Any

from vllm_mars.admission.base import PendingRoot
from vllm_mars.admission.mars.cost import fit_wait_s, rebuild_s_total
from vllm_mars.admission.mars.projection import LifeView
from vllm_mars.admission.mars.window import AimdWindow

#: (root, mode, footprint blocks, decision inputs for the admission event)
Choice = tuple[PendingRoot, str, int, dict]


class _Weighed:
    """A queued root's place in one projection view (``LifeView.memo``, keyed by its workflow): its
    footprint, (turns, tokens), whole-life peak with it and overflow blocks, sized for ``cap`` and
    ``bs``; once the cost rule asks: whether the pool keeps the contexts with it, its marginal
    overflow per turn and the turns that overflow."""

    __slots__ = ("blocks", "bs", "cand", "cap", "keeps", "over", "overflow_turns", "per_turn", "root",
                 "with_peak")

    def __init__(self, root: PendingRoot, cap: float, bs: int, blocks: int, cand: tuple[int, float],
                 with_peak: float, over: int) -> None:
        self.root, self.cap, self.bs, self.blocks, self.cand = root, cap, bs, blocks, cand
        self.with_peak, self.over = with_peak, over
        self.keeps: bool | None = None
        self.per_turn: list[float] = []
        self.overflow_turns = 0


class _Skipped:
    """The last cost-rule selection that admitted nothing, every root skipped because its rebuilds
    cost at least the slot's wait where the pool keeps the contexts: its view, capacity, block
    size, budget, stall factor and slot wait, and the roots it weighed (in queue order)."""

    __slots__ = ("budget", "bs", "cap", "queue_s", "roots", "stall", "view")

    def __init__(self, view: LifeView, cap: float, bs: int, budget: int, stall: int, queue_s: float,
                 roots: list[PendingRoot]) -> None:
        self.view, self.cap, self.bs, self.budget, self.stall, self.queue_s = view, cap, bs, budget, stall, queue_s
        self.roots = roots


class Selection(AimdWindow):
    """The selection half of :class:`~vllm_mars.admission.mars.MarsAdmissionController`."""

    _turn_growth: float

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        #: The last cost-rule selection that admitted nothing, every root skipped where the pool
        #: keeps the contexts (see :meth:`_select`).
        self._skipped: _Skipped | None = None
        #: Queued roots weighed by the selections so far (a diagnostic: what the ticks cost)
        self.weighed = 0

    # hooks the controller provides
    def footprint_blocks(self, root: PendingRoot) -> int:
        raise NotImplementedError

    def _est_tokens(self, root: PendingRoot) -> int:
        raise NotImplementedError

    def _is_long(self, tokens: int) -> bool:
        raise NotImplementedError

    def _root_turns(self, root: PendingRoot) -> float:
        raise NotImplementedError

    def life_capacity_tokens(self) -> float | None:
        raise NotImplementedError

    def _life_view(self) -> LifeView:
        raise NotImplementedError

    def _queue_cost_s(self, now: float) -> float:
        raise NotImplementedError

    def _select(self, slots: int, budget: int | None, now: float) -> list[Choice]:
        """Pick up to ``slots`` roots: (root, mode, footprint blocks, decision inputs).

        What a queued root's place in the active roots' projection decides (its footprint, its
        whole-life peak and overflow, whether the pool keeps the contexts with it, its marginal
        overflow per turn) does not depend on the budget, the running calls or the slot's wait:
        it is kept per root in the projection's view (``view.memo``, keyed by the workflow), so a
        tick whose view is the previous one's reads it back and only weighs it against this
        tick's budget and prices.

        A root skipped under the cost rule where the pool keeps the contexts stays skipped while
        the view is the same, the budget does not grow, the running calls do not fall and the
        slot's wait does not grow (its shortfall, its rebuild seconds and their stall can only
        grow, the wait only shrink: rebuild seconds do not fall with more tokens, and the sum's
        terms are >= 0): a tick after one that admitted nothing and skipped every root that way
        weighs only the roots queued behind them since (``_skipped``)."""
        queue = self._queue
        if budget is None:  # missing telemetry: a small fixed window in arrival order
            return [(r, "no_telemetry_fcfs", self.footprint_blocks(r), {}) for r in islice(queue.values(), slots)]
        cfg = self.config
        cost_rule = self._rule() == "cost"
        foot: dict[str, int] | None = None
        order: Iterable[PendingRoot]
        if cost_rule:  # arrival order: nothing to size up front
            order, mode = queue.values(), "cost_fit"
        else:
            roots = list(queue.values())
            foot = {r.workflow: self.footprint_blocks(r) for r in roots}
            if not any(not self._is_long(self._est_tokens(r)) for r in roots):
                return self._drain(roots, slots, budget, foot)
            usage = self._usage()
            light = (not (self._kv_overloaded or self._stale)
                     and (usage is None or usage <= cfg.kv_low) and budget > 0
                     and len(roots) <= slots and sum(foot.values()) <= budget)
            if light:
                order, mode = roots, "light_fcfs"
            else:
                seq = self._seq
                order = sorted(roots, key=lambda r: (not self.returning(r), foot[r.workflow], seq[r.workflow]))
                mode = "smallest_fit"
        queue_s = self._queue_cost_s(now) if cost_rule else math.inf
        stall = self._stall_factor() if cost_rule else 1  # (admissions apply after the selection)
        cap = self.life_capacity_tokens() if cfg.size == "life" else None
        # The active roots' projection, kept between ticks while no root is admitted, ends or shows
        # a new turn; each candidate recomputes only what it changes (exactly: see LifeView).
        view = self._life_view() if cap is not None else None
        # (the active roots' own peak: needed only when a candidate's peak passes the capacity)
        peak: float | None = None
        bs = self._block_size()
        out: list[Choice] = []
        remaining = budget
        last = len(queue) - 1
        start, skipped, self._skipped = 0, self._skipped, None
        if (skipped is not None and cost_rule and skipped.view is view and skipped.cap == cap and skipped.bs == bs
                and budget <= skipped.budget and stall >= skipped.stall and queue_s <= skipped.queue_s):
            weighed = skipped.roots
            if len(weighed) <= len(queue) and list(islice(queue.values(), len(weighed))) == weighed:
                start = len(weighed)  # (the roots since are behind them: those go on being weighed)
                order = islice(queue.values(), start, None)
        all_kept = cost_rule and view is not None  # every root skipped where the pool keeps the contexts
        i = start - 1
        for i, r in enumerate(order, start):
            if len(out) >= slots:
                self.weighed -= 1  # (not weighed: counted below)
                break
            why: dict = {}
            if view is not None:
                assert cap is not None
                memo = view.memo
                wf = r.workflow
                st = memo.get(wf)
                if st is None or st.root is not r or st.cap != cap or st.bs != bs:
                    b = foot[wf] if foot is not None else self.footprint_blocks(r)
                    # Whole life: the candidate's context over all its turns joins the projection;
                    # what the peak gains beyond the capacity is its overflow.
                    cand = (self._root_turns(r), float(self._est_tokens(r)))
                    with_peak = memo.get(cand)
                    if with_peak is None:
                        with_peak = memo[cand] = view.peak_with(cand)
                    over = 0
                    if with_peak > cap:
                        if peak is None:
                            peak = view.peak()
                        over = max(0, math.ceil((with_peak - max(cap, peak)) / bs))
                    # else with_peak - max(cap, peak) <= 0: no overflow, whatever the peak
                    st = memo[wf] = _Weighed(r, cap, bs, b, cand, with_peak, over)
                else:
                    b, cand, with_peak, over = st.blocks, st.cand, st.with_peak, st.over
                if b <= remaining and over == 0:
                    why = {"life_peak_tokens": round(with_peak), "life_capacity_tokens": round(cap)}
                    out.append((r, mode, b, why))
                elif cost_rule:
                    lack = max(b - max(remaining, 0), 0)  # blocks short of the budget now
                    keeps = st.keeps
                    if keeps is None:
                        keeps = st.keeps = view.pool_keeps(cap, cfg.window_min, cand)
                        st.per_turn = per_turn = view.marginal_overflow(cand, cap)
                        st.overflow_turns = sum(map((0.0).__lt__, per_turn))  # (the turns with x > 0)
                    # the overflow priced turn by turn: what the candidate adds to the projection's
                    # excess over the pool at each of its coming turns (kept with the view, as the
                    # rebuild seconds it costs at a shortfall: only the stall factor is read now)
                    # Where the pool keeps the contexts, the wait is the slot's (queue_s): the sum
                    # stops once it reaches that (a root skipped all the same), kept as a lower bound.
                    bound = queue_s if keeps else math.inf
                    key = (cand, cap, bs, lack)
                    priced = memo.get(key)  # (rebuild seconds or a lower bound, overflow turns, exact)
                    if priced is None or (not priced[2] and priced[0] * stall < bound):
                        assert self.cost is not None
                        total = rebuild_s_total(self.cost, cand[0], bs, lack, st.per_turn, bound, stall)
                        priced = memo[key] = (total, st.overflow_turns, total * stall < bound)
                    rebuild_s = priced[0] * stall
                    wait_s = queue_s
                    if rebuild_s >= wait_s and keeps:
                        continue
                    why = {"life_peak_tokens": round(with_peak), "life_capacity_tokens": round(cap),
                           "overflow_turns": priced[1]}
                    if rebuild_s >= wait_s:
                        # No active set keeps the contexts: holding it only pays if a slot makes it fit.
                        all_kept = False
                        wait_s, k = fit_wait_s(lambda per_turn, r=r: self._rebuild_cost_s(r, 0, per_turn),
                                               view, cand, cap, queue_s, view.growth)
                        why["wait_slots"] = k
                        if rebuild_s >= wait_s:
                            continue
                    out.append((r, "cost_overflow", b, {**why, "overflow_blocks": lack + over,
                                                        "expected_rebuild_s": round(rebuild_s, 6),
                                                        "expected_queue_s": round(wait_s, 6)}))
                else:
                    continue
                remaining -= b
                if len(out) < slots and i < last:  # (a candidate follows)
                    view, peak = view.grown(cand), with_peak
                continue
            b = foot[r.workflow] if foot is not None else self.footprint_blocks(r)
            if b <= remaining:
                out.append((r, mode, b, why))
            elif cost_rule:
                lack = max(b - max(remaining, 0), 0)
                rebuild_s = self._rebuild_cost_s(r, lack)
                if rebuild_s >= queue_s:
                    continue
                out.append((r, "cost_overflow", b, {"overflow_blocks": lack, "expected_rebuild_s": round(rebuild_s, 6),
                                                    "expected_queue_s": round(queue_s, 6)}))
            else:
                continue
            remaining -= b
        self.weighed += i + 1 - start
        if not out and all_kept:
            assert view is not None and cap is not None
            self._skipped = _Skipped(view, cap, bs, budget, stall, queue_s, list(queue.values()))
        if not out and not self._active:
            oldest = next(iter(queue.values()))
            out.append((oldest, "oldest_alone", foot[oldest.workflow] if foot is not None
                        else self.footprint_blocks(oldest), {}))
        return out

    def _rebuild_cost_s(self, root: PendingRoot, overflow_blocks: int,
                        per_turn_tokens: list[float] | None = None) -> float:
        """:func:`.cost.rebuild_cost_s` for ``root`` with the running calls now."""
        return self._rebuild_s_total(root, overflow_blocks, per_turn_tokens) * self._stall_factor()

    def _rebuild_s_total(self, root: PendingRoot, overflow_blocks: int,
                         per_turn_tokens: list[float] | None = None, stop: float = math.inf,
                         factor: int = 1) -> float:
        assert self.cost is not None
        return rebuild_s_total(self.cost, self._root_turns(root), self._block_size(), overflow_blocks,
                               per_turn_tokens, stop, factor)

    def _stall_factor(self) -> int:
        """A rebuild stalls the running calls and itself: ``1 + running`` (the engine's, else the
        active roots)."""
        t = self._tel
        return 1 + (t.running if t is not None and t.running is not None else len(self._active))

    def _drain(self, queue: list[PendingRoot], slots: int, budget: int, foot: dict[str, int]) -> list[Choice]:
        """Only long roots wait: arrival order within the live budget, one at a time while any
        earlier admission is active; the oldest alone when none fits and nothing is active."""
        cap = 1 if self._active else slots
        out, remaining = [], budget
        for r in queue:
            if len(out) >= cap:
                break
            b = foot[r.workflow]
            if b <= remaining:
                out.append((r, "drain_fit", b, {}))
                remaining -= b
        if not out and not self._active:
            out.append((queue[0], "drain_oldest_alone", foot[queue[0].workflow], {}))
        return out
