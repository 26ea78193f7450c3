"""The MARS controller's selection reads back what it kept from earlier ticks and decides exactly as
a selection that computes everything again at every tick.

What a queued root's place in the active roots' projection decides (footprint, whole-life peak
and overflow, whether the pool keeps the contexts with it, its priced rebuilds) is kept in the
projection's view between ticks (``LifeView.memo``). The reference is the same controller with that
memo emptied before every tick: every number computed afresh. Both are driven through the same
long queue (100+ roots waiting) with the view kept for several ticks at a time, under the cost and
the footprint rules and both sizings; admissions, their order and every event field must agree.
A real sim run on a queue checks the same end to end (``events.jsonl`` and ``summary.json``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_admission_incremental import _workload
from vllm_mars.admission.base import PendingRoot, Telemetry
from vllm_mars.admission.mars import MarsAdmissionConfig, MarsAdmissionController
from vllm_mars.admission.mars.projection import LifeView
from vllm_mars.costmodel import CostModel
from vllm_mars.driver.runner import ReplayConfig, run_replay


def _fresh(monkeypatch) -> None:
    """The reference: the view's memo emptied whenever the controller reads the view, and no
    selection taking over the roots the previous one skipped."""
    orig_view, orig_select = MarsAdmissionController._life_view, MarsAdmissionController._select

    def view(self):
        v = orig_view(self)
        v.memo.clear()
        return v

    def select(self, *a):
        self._skipped = None
        return orig_select(self, *a)

    monkeypatch.setattr(MarsAdmissionController, "_life_view", view)
    monkeypatch.setattr(MarsAdmissionController, "_select", select)


def _drive(seed: int, options: dict) -> tuple[list[list[str]], list, dict]:
    """Roots arrive faster than they are let in (the queue passes 100); between ticks the active
    set changes only now and then (a new turn, a finish, a prefix hit), so a view serves several
    ticks, while the budget and the running calls move at every tick."""
    rng = random.Random(seed)
    c = MarsAdmissionController(MarsAdmissionConfig(**{"window_min": 2, "window_max": 12, **options}))
    c.set_cost_model(CostModel(prefill_s_per_token=2e-5, attn_s_per_token_ctx=1e-10, source="test"))
    total = 6000
    t, n, ticks, longest = 0.0, 0, [], 0
    free, running = 0, 5
    for step in range(400):
        t += 0.2
        if rng.random() < 0.4:  # (a reading often repeats the last one's free blocks and running calls)
            free = rng.choice((0, 0, 40, 900, 3000, rng.randrange(0, total)))
            running = rng.choice((2, 5, 9))
        c.observe(Telemetry(ts=t, free_blocks=free, total_blocks=total, block_size=16, running=running,
                            recomputed_tokens=step * 40, kv_blocks_removed=step))
        if rng.random() < 0.6:
            turns = rng.choice((None, 3, 6, 11, 18))
            tokens = rng.choice((None, rng.randrange(2000, 30_000), rng.randrange(2000, 30_000)))
            c.offer(PendingRoot(f"w{n}", t, tokens, {} if turns is None else {"turns": turns}))
            n += 1
        ticks.append(c.tick(t))
        longest = max(longest, c.num_queued)
        active = sorted(w for w in c._active)
        if active and rng.random() < 0.06:
            w = rng.choice(active)
            c.update_estimate(w, c._active[w].prefill_tokens + rng.randrange(100, 3000), t)
        if c.num_queued and rng.random() < 0.3:  # a queued root's estimate changes (a new root object)
            w = rng.choice(sorted(c._queue))
            was = c._queue[w].prefill_tokens  # (None: sized as 2048 tokens until a first estimate)
            c.update_estimate(w, rng.randrange(100, 1500) if was is None else was + rng.randrange(500, 8000), t)
        if active and rng.random() < 0.05:
            c.observe_cached(rng.choice(active), rng.randrange(0, 4000))
        if active and rng.random() < 0.05:
            c.finish(rng.choice(active), t, final_tokens=rng.randrange(5000, 40_000), turns=rng.randrange(2, 20))
    events = [(e.ts, e.event, e.data) for e in c.take_events()]
    return ticks, events, {"longest_queue": longest, "admitted": sum(map(len, ticks)), "weighed": c.weighed}


RULES = {"cost, life": {}, "footprint, life": {"admit": "footprint"}, "cost, turn": {"size": "turn"}}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("seed", range(3))
def test_kept_results_give_the_same_admissions_as_computing_everything_again(monkeypatch, rule, seed):
    ticks, events, stats = _drive(seed, RULES[rule])
    assert stats["longest_queue"] >= 100 and stats["admitted"] >= 20, stats
    modes = {d["mode"] for _, e, d in events if e == "admission_admit"}
    if rule == "cost, life":
        assert {"cost_fit", "cost_overflow"} <= modes, modes
    with monkeypatch.context() as m:
        _fresh(m)
        want_ticks, want_events, _ = _drive(seed, RULES[rule])
    assert ticks == want_ticks
    assert events == want_events


def test_the_kept_results_are_read_back_across_ticks(monkeypatch):
    """The case above exercises the reuse: with the memo kept, far fewer candidates are sized
    against the projection (whole-life peaks) or priced (marginal overflows) than with it emptied,
    and ticks after one that skipped every root weigh only the roots that arrived since."""
    counts = {"peak_with": 0, "marginal_overflow": 0, "weighed": 0}
    for name in ("peak_with", "marginal_overflow"):
        orig = getattr(LifeView, name)

        def counted(self, *a, _orig=orig, _name=name):
            counts[_name] += 1
            return _orig(self, *a)

        monkeypatch.setattr(LifeView, name, counted)
    kept = dict(counts, weighed=_drive(0, {})[2]["weighed"])
    counts.update(peak_with=0, marginal_overflow=0)
    _fresh(monkeypatch)
    counts["weighed"] = _drive(0, {})[2]["weighed"]
    assert kept["peak_with"] * 2 < counts["peak_with"], (kept, counts)
    assert kept["marginal_overflow"] * 2 < counts["marginal_overflow"], (kept, counts)
    assert kept["weighed"] * 3 < counts["weighed"] * 2, (kept, counts)


def test_a_sim_run_on_a_queue_is_the_same_with_the_kept_results(tmp_path, monkeypatch):
    """A real mars run on the sim with roots queueing (14 roots into a 400-block pool at 4 roots/s):
    ``events.jsonl`` and ``summary.json`` byte for byte equal with and without the kept results."""
    wl = _workload(tmp_path / "wl.jsonl")

    def run(name: str) -> Path:
        out, _ = run_replay(ReplayConfig(workload=str(wl), policy="mars", rps=4.0, backend="sim",
                                         profile="h200-qwen3-coder-30b-a3b", num_blocks=400, progress=False,
                                         plots=False, out=str(tmp_path / name)))
        return out

    kept = run("kept")
    _fresh(monkeypatch)
    fresh = run("fresh")
    summary = json.loads((kept / "summary.json").read_text())
    assert summary["completed"] == 14 and summary["errors"] == 0
    assert summary["engine"]["leak_check"] == "ok"
    events = (kept / "events.jsonl").read_text()
    assert events.count('"admission_admit"') == 14 and '"mode":"cost_overflow"' in events
    for f in ("summary.json", "events.jsonl"):
        assert (kept / f).read_bytes() == (fresh / f).read_bytes(), f
