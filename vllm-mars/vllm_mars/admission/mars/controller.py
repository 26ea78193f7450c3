"""The MARS admission controller: what it learns from its feeder, its sizing of roots, and the tick.

The window is :class:`~.window.AimdWindow`'s, the choice of roots :class:`~.selection.Selection`'s;
this class keeps the state both read:

* **Footprint** of a waiting root: ``ceil((prefill_tokens + turn_growth) / block_size)``: the KV its
  first call needs plus one turn of growth. ``turn_growth`` is an EMA of tokens added per turn,
  learned from each active root's next turn (``update_estimate``) and, for roots that never showed
  one, ``(final tokens - first prompt) / turns`` at their finish.
* **Budget**: ``free_blocks - ceil(total * (1 - kv_target))`` minus the blocks promised to roots
  admitted since the last telemetry that could show them. Zero free blocks is a zero budget.
* **Whole-life items** (``size = "life"``): each active root's remaining turns and context, less the
  prefix its first call found in the prefix cache (KV shared with other workflows, already counted
  with theirs; ``observe_cached``).
* **Slot wait**: a root's expected active time over the roots active: the finished roots' active
  time per turn (an EMA) times the mean turns of the roots admitted (before any finished, the
  longest active so far). Per turn, because the roots that finish first are those with few turns.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left, insort
from dataclasses import dataclass

from vllm_mars.admission.base import AdmissionEvent, PendingRoot, Telemetry, register_controller
from vllm_mars.admission.mars.config import MarsAdmissionConfig
from vllm_mars.admission.mars.projection import Item, LifeView, pred_turns, reported_turns
from vllm_mars.admission.mars.selection import Selection
from vllm_mars.costmodel import CostModel

logger = logging.getLogger(__name__)


@dataclass
class _Active:
    workflow: str
    admitted_at: float
    blocks: int
    long: bool
    #: Its latest context: the prompt of its latest turn seen (the offer's estimate until then).
    prefill_tokens: int
    turns: int | None = None
    #: Turns observed so far.
    seen: int = 1
    #: Tokens of its first prompt found in the prefix cache (None: not reported).
    shared: int | None = None
    #: The turns it was predicted to make when admitted (its reported ``turns``, else the learned mean).
    pred_turns: float = 0.0


@register_controller
class MarsAdmissionController(Selection):
    """The MARS admission controller (rules: :mod:`vllm_mars.admission.mars`)."""

    name = "mars"
    config_cls = MarsAdmissionConfig
    config: MarsAdmissionConfig
    _active: dict[str, _Active]

    def __init__(self, config: MarsAdmissionConfig | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.cost: CostModel | None = None
        # A root's active time (see _service_time_s):
        self._turn_s = 0.0  # EMA over finished roots of their active time per turn
        self._finished = 0  # roots finished so far
        self._admitted_turns = 0.0  # the turns of every root admitted (predicted until it ends), summed
        self._admitted_n = 0  # ... and how many
        self._turns = float(cfg.default_turns)  # EMA of LLM calls per root
        self._waiting_ema: float | None = None  # EMA of calls waiting in the engine, per reading
        self._cost_warned = False
        self._turn_growth = 0.0  # learned tokens added per turn (0 until a workflow reports)
        self._grown = 0  # turn-growth observations so far
        self._life_version = 0  # bumped when the active set or a root's progress changes
        # The whole-life items, kept sorted as roots change (see _life_items)
        self._life_built = -1  # the version they are of
        self._life_turns: float | None = None  # the learned turns they were computed with
        self._life_rows: dict[str, Item] = {}  # each active root's item
        self._life_sorted: list[Item] = []  # the items, fewest remaining turns first
        self._life_dirty: set[str] = set()  # roots admitted, ended or changed since
        self._life_learned: set[str] = set()  # roots whose turns are the learned mean
        self._life_items_desc: list[Item] = []  # the same, most remaining turns first
        self._life_view_cache: tuple[int, float, CostModel | None, LifeView] | None = None
        if cfg.cost_model:
            self.set_cost_model(CostModel.load(cfg.cost_model))

    def set_cost_model(self, model: CostModel | None) -> None:
        """Price rebuilds with ``model`` (the "cost" rule; None: the footprint rules)."""
        self.cost = model
        if model is not None and self.config.admit == "cost" and self.config.window_init is None:
            self.window = self.config.window_max  # work-conserving start; AIMD is the safety net
        self._emit(self._tel.ts if self._tel else 0.0, "admission_cost_model", {
            "rule": self._rule(), "source": None if model is None else model.source,
            "calibrated": None if model is None else model.calibrated})

    def _rule(self) -> str:
        return "cost" if self.config.admit == "cost" and self.cost is not None else "footprint"

    # -- feeding ----------------------------------------------------------------------------------
    def _on_finish(self, act: _Active, now: float, final_tokens: int | None, turns: int | None) -> None:
        """An admitted root ended. ``final_tokens``, when known, is its last call's prompt+output
        size and ``turns`` its number of LLM calls (else the ``turns`` key of the root's
        ``PendingRoot.meta``): together they refine the per-turn growth estimate."""
        a = self.config.growth_alpha
        n = turns if turns is not None else act.turns
        made = n if n is not None and n > 0 else act.seen
        per_turn = max(now - act.admitted_at, 0.0) / made
        self._turn_s = per_turn if self._finished == 0 else (1 - a) * self._turn_s + a * per_turn
        self._finished += 1
        self._admitted_turns += made - act.pred_turns  # the turns it made, not those predicted
        if n is not None and n > 0:
            self._turns = (1 - a) * self._turns + a * n
        self._life_version += 1
        self._life_dirty.add(act.workflow)
        if act.seen > 1:
            return  # its growth was learned turn by turn
        if final_tokens is not None and final_tokens > 0 and n is not None and n > 0:
            per_turn = min(self.config.turn_growth_max_tokens, max(0.0, (final_tokens - act.prefill_tokens) / n))
            self._turn_growth = (1 - a) * self._turn_growth + a * per_turn

    def observe(self, telemetry: Telemetry) -> None:
        super().observe(telemetry)
        if self._tel is telemetry:
            self._measure_rebuilds(telemetry)
            if telemetry.waiting is not None:
                w = float(telemetry.waiting)
                self._waiting_ema = w if self._waiting_ema is None else 0.8 * self._waiting_ema + 0.2 * w

    def _on_reestimate(self, act: _Active, prefill_tokens: int, now: float) -> None:
        # A later turn's prompt: the context grew by one turn (tool output, the previous answer).
        # Learned online from every active root, so early roots are sized before any finishes.
        self._life_dirty.add(act.workflow)
        if act.prefill_tokens and prefill_tokens > act.prefill_tokens:
            a = self.config.growth_alpha
            step = min(self.config.turn_growth_max_tokens, prefill_tokens - act.prefill_tokens)
            self._turn_growth = step if self._grown == 0 else (1 - a) * self._turn_growth + a * step
            self._grown += 1
            act.seen += 1
            self._life_version += 1
        # growth is measured from the agent's context, not from a short side call it was offered on
        act.prefill_tokens = max(act.prefill_tokens, prefill_tokens)

    def _on_cached(self, act: _Active, cached_tokens: int) -> None:
        if act.shared is None:  # the first call's hit: the root had no KV of its own yet
            act.shared = cached_tokens
            self._life_version += 1
            self._life_dirty.add(act.workflow)
            self._emit(self._tel.ts if self._tel else 0.0, "admission_shared", {
                "workflow": act.workflow, "cached_tokens": cached_tokens, "prefill_tokens": act.prefill_tokens,
                "counted": "unique"})

    def _own_tokens(self, act: _Active) -> float:
        """What ``act``'s context adds to the pool: its context less the prefix its first call
        found cached."""
        if act.shared:
            return float(max(0, act.prefill_tokens - act.shared))
        return float(act.prefill_tokens)

    @property
    def turn_growth(self) -> float:
        """Learned tokens added per turn (footprints add one turn of it)."""
        return self._turn_growth

    # -- derived state ----------------------------------------------------------------------------
    def _block_size(self) -> int:
        t = self._tel
        return t.block_size if t is not None and t.block_size else self.config.default_block_size

    def _est_tokens(self, root: PendingRoot) -> int:
        return self.config.unknown_prefill_tokens if root.prefill_tokens is None else root.prefill_tokens

    def footprint_blocks(self, root: PendingRoot) -> int:
        """KV blocks this root is expected to need: its prefix plus one turn of learned growth."""
        return math.ceil((self._est_tokens(root) + self._turn_growth) / self._block_size())

    def _is_long(self, tokens: int) -> bool:
        lim = self.config.long_prefill_tokens
        return lim > 0 and tokens > lim

    def budget_blocks(self) -> int | None:
        """Free blocks above the guard margin, minus promises; None when telemetry is missing."""
        if not self._telemetry_usable():
            return None
        t = self._tel
        assert t is not None and t.free_blocks is not None and t.total_blocks
        reserve = math.ceil(t.total_blocks * (1 - self.config.kv_target))
        return max(0, t.free_blocks - reserve - self._promised())

    def _root_turns(self, root: PendingRoot) -> float:
        """LLM calls a queued root makes (its reported ``turns``, else the learned mean)."""
        return pred_turns(root.meta.get("turns") if root.meta else None, self._turns)

    def _life_row(self, a: _Active) -> Item:
        """(remaining turns, current context tokens) of active root ``a``."""
        return (max(pred_turns(a.turns, self._turns) - a.seen + 1, 1.0), self._own_tokens(a))

    def _life_items(self) -> list[Item]:
        """The active roots' items, most remaining turns first, as of the last time a root was
        admitted, finished or showed a new turn (``_life_version``). Kept sorted incrementally:
        only the roots that changed since (and, when the learned mean of turns moved, the roots
        sized by it) are computed again and moved in the order."""
        if self._life_built != self._life_version:
            rows, lst, dirty = self._life_rows, self._life_sorted, self._life_dirty
            if self._life_turns != self._turns:
                dirty |= self._life_learned
                self._life_turns = self._turns
            if 4 * len(dirty) > len(rows) + 8:  # many changed: build it again
                rows.clear()
                self._life_learned.clear()
                dirty = set(self._active)
                lst.clear()
            for wf in dirty:
                old = rows.pop(wf, None)
                if old is not None:
                    del lst[bisect_left(lst, old)]
                a = self._active.get(wf)
                if a is None:
                    self._life_learned.discard(wf)
                    continue
                rows[wf] = new = self._life_row(a)
                insort(lst, new)
                if reported_turns(a.turns) is None:
                    self._life_learned.add(wf)
                else:
                    self._life_learned.discard(wf)
            self._life_dirty.clear()
            self._life_items_desc = lst[::-1]
            self._life_built = self._life_version
            if LifeView.check:
                assert self._life_items_desc == sorted((self._life_row(a) for a in self._active.values()),
                                                       reverse=True), "incremental life items"
        return self._life_items_desc

    def _life_view(self) -> LifeView:
        """:class:`LifeView` of :meth:`_life_items` at the learned growth (with what candidates
        cached in it: kept while the items, the growth and the cost model stay)."""
        items = self._life_items()
        g = self._turn_growth
        c = self._life_view_cache
        if c is not None and c[0] == self._life_version and c[1] == g and c[2] is self.cost:
            view = c[3]
            if len(view.memo) > 10_000:  # (a long spell without any change: bounded)
                view.memo.clear()
            return view
        # the previous view's folds carry over the items both start with (at the same growth)
        view = LifeView(items, g, prev=c[3] if c is not None else None)
        self._life_view_cache = (self._life_version, g, self.cost, view)
        return view

    def life_capacity_tokens(self) -> float | None:
        """Tokens the active roots may project to: ``life_target`` of the pool (None: no telemetry)."""
        if not self._telemetry_usable():
            return None
        t = self._tel
        assert t is not None and t.total_blocks
        return t.total_blocks * self._block_size() * self.config.life_target

    def _net_applies(self) -> bool:
        """Measured rebuilds shrink the window only while the pool keeps ``window_min`` of the
        contexts the roots will have (else fewer active roots are evicted all the same)."""
        cap = self.life_capacity_tokens()
        return cap is None or self._life_view().pool_keeps(cap, self.config.window_min)

    def _service_time_s(self, now: float) -> float:
        """A root's expected active time (admission to finish): the finished roots' active time per
        turn (an EMA) times the mean turns of the roots admitted (the finished ones' own, the
        active ones' predicted); before any root finished, the longest active so far. (The finished
        roots' active time itself would be biased short while the run is young: the roots that
        finish first are those with few turns.)"""
        if not self._finished or not self._admitted_n:
            return max((now - a.admitted_at for a in self._active.values()), default=0.0)
        return self._turn_s * self._admitted_turns / self._admitted_n

    def _queue_cost_s(self, now: float) -> float:
        """Expected wait for the next slot: a root's expected active time over the roots active."""
        if not self._active:
            return math.inf
        return self._service_time_s(now) / len(self._active)

    def _inputs(self, now: float) -> dict:
        t = self._tel
        ratio = self._cpu_backlog_ratio()
        return {
            "telemetry_age_s": None if t is None else round(now - t.ts, 6),
            "free_blocks": None if t is None else t.free_blocks,
            "total_blocks": None if t is None else t.total_blocks,
            "kv_usage": self._usage(),
            "tools_in_flight": None if t is None else t.tools_in_flight,
            "tool_workers": None if t is None else t.tool_workers,
            "tool_queue_wait_s": None if t is None else t.tool_queue_wait_s,
            "cpu_backlog_ratio": ratio,
            "engine_running": None if t is None else t.running,
            "engine_waiting": None if t is None else t.waiting,
            "engine_waiting_ema": None if self._waiting_ema is None else round(self._waiting_ema, 4),
        }

    # -- the control step -------------------------------------------------------------------------
    def tick(self, now: float) -> list[str]:
        if not self._cost_warned and self.config.admit == "cost" and self.cost is None:
            self._cost_warned = True
            logger.warning("mars admission: no cost model, so no cost-aware admission (footprint rules)")
            self._events.append(AdmissionEvent(now, "admission_cost_model", {
                "controller": self.name, "rule": "footprint", "source": None, "calibrated": False,
                "note": "no cost model: the footprint rules apply (pass cost_model, or run under the driver)"}))
        self._update_pressure(now)
        self._update_window(now)
        if not self._queue:
            return []
        limit = self.limit()
        slots = limit - len(self._active)
        budget = self.budget_blocks()
        # limit >= window_min >= 1, so an empty active set always has a slot
        admitted = self._select(slots, budget, now) if slots > 0 else []
        if not admitted:
            return []
        ctx = {"controller": self.name, "limit": limit, "window": self.window, "kv_budget_blocks": budget,
               "turn_growth_tokens": round(self._turn_growth, 1), "rule": self._rule(),
               "rebuild_share": self._rebuild_share, **self._inputs(now)}
        remaining = budget
        out = []
        for root, mode, blocks, why in admitted:
            tokens = self._est_tokens(root)
            if remaining is not None:
                remaining = max(0, remaining - blocks)
            self._admit(root, now, self._track(root, now, blocks, tokens), blocks, self.config.promise_s)
            out.append(root.workflow)
            self._events.append(AdmissionEvent(now, "admission_admit", {
                **ctx, "workflow": root.workflow, "mode": mode, "prefill_tokens_est": tokens,
                "footprint_blocks": blocks, "long": self._is_long(tokens), "kv_budget_remaining": remaining,
                "active": len(self._active), "queued": len(self._queue), "waited_s": round(now - root.arrival, 6),
                **why}))
        logger.debug("admitted %s (limit %s, budget %s)", out, limit, budget)
        return out

    def _track(self, root: PendingRoot, now: float, blocks: int, tokens: int) -> _Active:
        """The record of a root going active (admitted or adopted), counted in the slot wait's mean
        turns and marked for the life projection."""
        turns = root.meta.get("turns") if root.meta else None
        pred = self._root_turns(root)
        self._admitted_turns += pred
        self._admitted_n += 1
        self._life_version += 1
        self._life_dirty.add(root.workflow)
        return _Active(root.workflow, now, blocks, self._is_long(tokens), tokens,
                       turns if isinstance(turns, int) else None, pred_turns=pred)

    def _adoption(self, root: PendingRoot, now: float) -> tuple[_Active, int, float]:
        """An adopted root (:meth:`ControllerBase.adopt`) is tracked like one this tick admitted."""
        blocks = self.footprint_blocks(root)
        return self._track(root, now, blocks, self._est_tokens(root)), blocks, self.config.promise_s

    def snapshot(self) -> dict:
        """State for /metrics and debugging."""
        return {**super().snapshot(),
                "kv_budget_blocks": self.budget_blocks(), "turn_growth_tokens": self._turn_growth,
                "kv_overloaded": self._kv_overloaded,
                "stale": self._stale, "rule": self._rule(), "rebuild_share": self._rebuild_share,
                "cost_model": None if self.cost is None else self.cost.as_dict()}
