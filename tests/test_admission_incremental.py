"""The MARS controller's incremental selection decides exactly as the full recomputation.

The controller keeps its active roots' whole-life items sorted as roots change, and prices each
queued candidate from a :class:`LifeView` of them (the folds kept, only what the candidate changes
summed again, results kept between ticks while nothing changes). Every number must be the one the
plain functions in ``projection`` give over ``sorted([*items, cand], reverse=True)``, bit for bit:
random cases with ties and fractional turns, a controller driven through every change of state,
and a real sim run with ``LifeView.check`` on (each result compared with the full recomputation as
it is made)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from vllm_mars.admission.base import PendingRoot, Telemetry
from vllm_mars.admission.mars import MarsAdmissionConfig, MarsAdmissionController
from vllm_mars.admission.mars import selection as selection_mod
from vllm_mars.admission.mars.cost import fit_wait_s, rebuild_cost_s
from vllm_mars.admission.mars.projection import (
    LifeView,
    later_items,
    life_peak,
    marginal_overflow,
    pool_keeps,
    projection,
)
from vllm_mars.costmodel import CostModel
from vllm_mars.driver.runner import ReplayConfig, run_replay


def _case(rng: random.Random):
    """Items with ties in turns and contexts, fractional turns, a candidate often equal to one."""
    n = rng.randrange(0, 14)
    rems = [float(rng.randrange(1, 12)) if rng.random() < 0.7 else rng.uniform(1.0, 12.0) for _ in range(n)]
    ctxs = [float(rng.choice((0, 100, 900, 2500))) if rng.random() < 0.5 else rng.uniform(0, 5000) for _ in range(n)]
    items = sorted(zip(rems, ctxs), reverse=True)
    if items and rng.random() < 0.3:
        cand = rng.choice(items)
    else:
        cand = (float(rng.randrange(1, 16)) if rng.random() < 0.7 else rng.uniform(1.0, 16.0),
                float(rng.choice((0, 300, 2500))) if rng.random() < 0.3 else rng.uniform(0, 6000))
    g = rng.choice((0.0, 137.0, rng.uniform(0, 900)))
    total = sum(c + g * r for r, c in items) + cand[1] + g * cand[0]
    cap = rng.uniform(0.2, 1.2) * max(total, 1.0)
    return items, cand, g, cap


@pytest.mark.parametrize("seed", range(6))
def test_life_view_gives_the_functions_numbers_bit_for_bit(seed):
    rng = random.Random(seed)
    cost = CostModel(prefill_s_per_token=1e-4, attn_s_per_token_ctx=1e-9, source="test")
    for _ in range(400):
        items, cand, g, cap = _case(rng)
        view = LifeView(list(items), g)
        grown = sorted([*items, cand], reverse=True)
        assert view.peak() == life_peak(items, g)
        assert view.peak_with(cand) == life_peak(grown, g)
        assert view.marginal_overflow(cand, cap) == marginal_overflow(items, grown, cap, g)
        assert view.projection() == projection(items, g)
        assert view.grown(cand).items == grown
        assert view.grown(cand).peak() == life_peak(grown, g)
        for keep in (1, 4):
            assert view.pool_keeps(cap, keep) == pool_keeps(cap, items, g, keep)
            assert view.pool_keeps(cap, keep, cand) == pool_keeps(cap, items, g, keep, cand)
        for _, (rem, _) in zip(range(3), items):
            later = later_items(items, rem, g)
            assert view.later(rem).items == later
            assert view.later(rem).marginal_overflow(cand, cap) == marginal_overflow(
                later, sorted([*later, cand], reverse=True), cap, g)

        def rebuild(per_turn, cand=cand):
            return rebuild_cost_s(cost, cand[0], 3, 16, 0, per_turn)

        assert fit_wait_s(rebuild, view, cand, cap, 7.5, g) == fit_wait_s(rebuild, items, cand, cap, 7.5, g)
        # items out of order (what a later view falls back on): the functions' numbers all the same
        shuffled = rng.sample(items, len(items))
        if shuffled:
            assert LifeView(shuffled, g, is_sorted=False).marginal_overflow(cand, cap) == marginal_overflow(
                shuffled, sorted([*shuffled, cand], reverse=True), cap, g)


def test_the_functions_are_what_the_view_is_checked_against():
    # a view that summed in another order would differ in the last bits: the check must see it
    items = [(5.0, 0.1), (4.0, 0.2), (3.0, 0.3)]
    view = LifeView(items, 0.0)
    assert view.peak() == life_peak(items, 0.0) == (0.1 + 0.2) + 0.3
    assert (0.1 + 0.2) + 0.3 != 0.1 + (0.2 + 0.3)
    assert view.peak_with((4.5, 0.7)) == ((0.1 + 0.7) + 0.2) + 0.3


def _checked_controller(rng: random.Random) -> MarsAdmissionController:
    c = MarsAdmissionController(MarsAdmissionConfig(window_min=2, window_max=24))
    c.set_cost_model(CostModel(prefill_s_per_token=2e-5, source="test"))
    return c


def test_the_controllers_kept_items_follow_every_change(monkeypatch):
    """Admissions, finishes (moving the learned mean of turns), new turns, prefix hits and a root
    offered with a zero estimate (its context changes without a new turn): after each, the kept
    items equal the full sort (``LifeView.check`` asserts it), and the ticks run the cost rule."""
    monkeypatch.setattr(LifeView, "check", True)
    c, admitted, events = _drive(random.Random(7))
    assert len(admitted) > 60 and c.num_active > 0
    modes = {e.data["mode"] for e in events if e.event == "admission_admit"}
    assert "cost_overflow" in modes and "cost_fit" in modes


def test_the_rebuild_sum_stops_early_only_where_the_decision_is_the_same(monkeypatch):
    """A skipped root's rebuild sum stops once it reaches the slot's wait; the same run with the
    sum always taken in full admits the same roots at the same ticks with the same events."""
    stops = []
    orig = selection_mod.rebuild_s_total

    def full(*a, **kw):  # the sum taken in full: the reference
        return orig(*a[:5])

    def counted(*a, **kw):
        out = orig(*a)
        stops.append(out < orig(*a[:5]))
        return out

    monkeypatch.setattr(selection_mod, "rebuild_s_total", full)
    _, want, want_events = _drive(random.Random(11))
    monkeypatch.setattr(selection_mod, "rebuild_s_total", counted)
    _, got, got_events = _drive(random.Random(11))
    assert got == want and [(e.ts, e.event, e.data) for e in got_events] == [
        (e.ts, e.event, e.data) for e in want_events]
    assert sum(stops) > 20, "no sum stopped early: the case does not exercise the early exit"


def _drive(rng: random.Random):
    c = _checked_controller(rng)
    t, n, admitted = 0.0, 0, []
    for step in range(300):
        t += 0.2
        c.observe(Telemetry(ts=t, free_blocks=rng.randrange(0, 4000), total_blocks=4000, block_size=16,
                            running=rng.randrange(0, 20), recomputed_tokens=step * 50, kv_blocks_removed=step))
        for _ in range(rng.randrange(0, 3)):
            turns = rng.choice((None, 3, 8, 15, True))
            tokens = rng.choice((0, None, rng.randrange(500, 9000)))
            c.offer(PendingRoot(f"w{n}", t, tokens, {} if turns is None else {"turns": turns}))
            n += 1
        admitted += c.tick(t)
        active = [w for w in admitted if c.is_active(w)]
        if active and rng.random() < 0.6:
            w = rng.choice(active)
            c.update_estimate(w, c._active[w].prefill_tokens + rng.randrange(0, 3000), t)
        if active and rng.random() < 0.3:
            c.observe_cached(rng.choice(active), rng.randrange(0, 4000))
        if active and rng.random() < 0.25:
            c.finish(rng.choice(active), t, final_tokens=rng.randrange(1000, 20000), turns=rng.randrange(1, 20))
        c._life_view()  # (the check runs where the items are read)
    return c, admitted, c.take_events()


def _workload(path: Path, n: int = 14) -> Path:
    """``n`` workflows of 3-9 turns (reported), 1.5-3k-token contexts growing by 150-400 tokens a turn,
    arriving faster than a 6k-token pool lets them in: roots queue and are priced at every tick."""
    lines = []
    for i in range(n):
        k = 3 + i % 7
        turns = [{"append_tokens": 150 + 50 * (i % 6), "output_tokens": 40 + 7 * (i % 5),
                  "tool_s": 0.5 + 0.3 * (j % 4), "tool": "bash"} for j in range(k - 1)]
        turns.insert(0, {"output_tokens": 50, "tool_s": 0.4, "tool": "read"})
        turns[-1] = {"append_tokens": 64, "output_tokens": 30}
        lines.append(json.dumps({"schema": "mars_workload_v1", "workflow_id": f"w{i}",
                                 "prompt_tokens": 1500 + 113 * i, "turns": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_sim_run_checks_every_incremental_result(tmp_path, monkeypatch):
    """A real mars run on the sim with every LifeView result compared with the full recomputation
    as it is made (an AssertionError would fail the run), and the candidates' results reused
    between ticks."""
    monkeypatch.setattr(LifeView, "check", True)
    calls = {"peak_with": 0, "marginal_overflow": 0, "reused": 0}
    for name in ("peak_with", "marginal_overflow"):
        orig = getattr(LifeView, name)

        def counted(self, *a, _orig=orig, _name=name):
            calls[_name] += 1
            return _orig(self, *a)

        monkeypatch.setattr(LifeView, name, counted)
    orig_view = MarsAdmissionController._life_view

    def view(self):
        v = orig_view(self)
        calls["reused"] += bool(v.memo)
        return v

    monkeypatch.setattr(MarsAdmissionController, "_life_view", view)
    out, _ = run_replay(ReplayConfig(workload=str(_workload(tmp_path / "wl.jsonl")), policy="mars", rps=4.0,
                                     backend="sim", profile="h200-qwen3-coder-30b-a3b", num_blocks=400,
                                     progress=False, plots=False, out=str(tmp_path / "run")))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 14 and summary["errors"] == 0
    assert summary["engine"]["leak_check"] == "ok"
    assert calls["peak_with"] > 50 and calls["marginal_overflow"] > 20 and calls["reused"] > 20, calls


def _prefix_folds(items, g):
    """(sum of the contexts, life_peak) of each start ``items[:k]``, k = 0..len: the plain loop."""
    out, base = [(0.0, 0.0)], 0.0
    for k, (_, ctx) in enumerate(items, 1):
        base += ctx
        out.append((base, life_peak(items[:k], g)))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_a_view_starts_from_the_previous_views_folds_only_where_the_items_are_the_same(seed):
    """A new view (a root admitted, ended or changed) takes the previous view's folds over the
    items both start with, and sums only from the first item that differs: every fold it gives
    is the plain loop's over its own items. A reuse that kept a sum past the first difference,
    or kept the peaks at another growth, gives a stale number here."""
    rng = random.Random(100 + seed)
    reused = 0
    for _ in range(300):
        items, cand, g, _ = _case(rng)
        prev = LifeView(list(items), g)
        prev.peak() if rng.random() < 0.7 else prev.peak_with(cand)  # folds to the end, or to the candidate
        new = list(items)
        change = rng.random()
        if new and change < 0.4:  # a root's context or turns changed: it moves in the order
            i = rng.randrange(len(new))
            rem, ctx = new.pop(i)
            new.append((rem, ctx + rng.choice((1.0, 250.0, rng.uniform(1, 900)))) if rng.random() < 0.6
                       else (rem + rng.choice((-1.0, 1.0, 0.5)), ctx))
        elif new and change < 0.7:  # a root ended
            del new[rng.randrange(len(new))]
        else:  # a root admitted
            new.append(cand)
        new.sort(reverse=True)
        g2 = g if rng.random() < 0.8 else g + rng.choice((1.0, 0.25))  # the learned growth moved
        view = LifeView(new, g2, prev=prev)
        shared = next((i for i, (a, b) in enumerate(zip(items, new)) if a != b), min(len(items), len(new)))
        want = _prefix_folds(new, g2)
        start = view._reuse() if view._prev is not None else ([0.0], [0.0])
        # what it takes over: at most the shared start, and exactly the plain loop's numbers there
        assert len(start[0]) - 1 <= shared and len(start[0]) == len(start[1])
        assert list(zip(*start)) == want[:len(start[0])]
        if g2 == g and len(start[0]) > 1:
            reused += 1
        view = LifeView(new, g2, prev=prev)
        assert [view._fold_to(k) for k in range(len(new) + 1)] == want
        view = LifeView(new, g2, prev=prev)
        assert view.peak_with(cand) == life_peak(sorted([*new, cand], reverse=True), g2)
        assert view.peak() == life_peak(new, g2)
    assert reused > 100  # the reuse path ran (a long shared start at the same growth)
