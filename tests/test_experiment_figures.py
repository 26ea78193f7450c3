"""The paper's figures and the admission yardstick of ``mars experiment run``: a tiny sim grid with
``figures = "all"``, a static-cap sweep and an ablation draws every PNG from the recorded cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPACT = REPO / "benchmark" / "workloads" / "compact.jsonl"

GRID = f"""
name = "figures"
backend = "sim"
profile = "h200-qwen3-coder-30b-a3b"
arrival = "fixed"
num_workflows = 4
figures = "all"
policies = ["mars", "fcfs", "mars-no-admission", "fcfs-cap1", "fcfs-cap2"]

[variants.fcfs-cap1]
policy = "fcfs-cap"
admission_options = {{ cap = 1 }}

[variants.fcfs-cap2]
policy = "fcfs-cap"
admission_options = {{ cap = 2 }}

[replay]
num_blocks = 96

[[workloads]]
name = "compact"
path = "{COMPACT}"
rps = [1, 8]
"""


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from vllm_mars.experiment.grid import run_experiment
    from vllm_mars.experiment.spec import load_experiment

    d = tmp_path_factory.mktemp("figures")
    (d / "exp.toml").write_text(GRID)
    exp = load_experiment(d / "exp.toml")
    return exp, d / "out", run_experiment(exp, d / "out", progress=False)


def test_every_figure_is_drawn_from_the_cells(grid):
    from vllm_mars.experiment.figures import FIGURES

    exp, out, record = grid
    assert exp.figures == tuple(FIGURES)
    for name, (fname, _) in FIGURES.items():
        assert (out / fname).stat().st_size > 5000, name
        assert f"]({fname})" in (out / "table.md").read_text()
    for c in record["cells"]:
        d = out / "runs" / "compact" / f"rps{c['rps']:g}" / "seed0"
        for p, rec in c["policies"].items():
            s = json.loads((d / p / "summary.json").read_text())
            assert s["completed"] == 4 and s["engine"]["leak_check"] == "ok", p  # the sim's leak check
            fig = rec["figure"]
            assert rec["p90_e2e_s"] == s["e2e_s"]["p90"]
            assert set(fig["ttft_by_round_p50_p90_p99"]) == set(s["ttft_by_round"])
            assert len(fig["kv_removed_by_progress"]) == 10 and fig["computed_tokens_per_s"] > 0
        ws = c["workload_stats"]
        assert ws["roots"] == 4 and len(ws["t_ideal_s_q"]) == 21 and ws["t_ideal_s_q"][0] > 0
        assert ws["first_prompt_tokens_q"][0] >= 128


def test_series_counts(grid, tmp_path):
    from vllm_mars.experiment import figures as f
    from vllm_mars.metrics.report import _plt

    exp, _, record = grid
    plt, cells = _plt(), record["cells"]
    drawn = ["mars", "fcfs", "mars-no-admission"]  # the swept caps are in their own table, not lines
    assert f.fig_e2e(plt, exp, cells, tmp_path / "a.png") == len(drawn)
    assert f.fig_throughput_goodput(plt, exp, cells, tmp_path / "b.png") == len(drawn)
    assert f.fig_kv_removals(plt, exp, cells, tmp_path / "c.png") == len(drawn)
    assert f.fig_ttft_rounds(plt, exp, cells, tmp_path / "d.png") == len(drawn)
    assert f.fig_inputs(plt, exp, cells, tmp_path / "e.png") == 1
    assert f.fig_ablations(plt, exp, cells, tmp_path / "g.png") == 1  # mars-no-admission


def test_pressure_shows_in_the_removals(grid):
    """96 blocks for 4 compact workflows at 8 roots/s: fcfs loses context between turns; the
    removals the figure draws are the rebuilt context blocks (prompt tokens not cached)."""
    _, _, record = grid
    hot = next(c for c in record["cells"] if c["rps"] == 8)
    assert sum(hot["policies"]["fcfs"]["figure"]["kv_removed_by_progress"]) > 0


def test_removals_by_progress_counts_the_blocks_a_call_lost():
    from vllm_mars.experiment.figures import removals_by_progress

    rounds = [{"prompt_tokens": 160, "output_tokens": 16, "cached_tokens": 0},
              # 175 tokens had KV (the last output token never does): 10 full blocks, all found
              {"prompt_tokens": 200, "output_tokens": 10, "cached_tokens": 160},
              {"prompt_tokens": 240, "output_tokens": 10, "cached_tokens": 64},    # 209 -> 13 blocks, 4 found
              {"prompt_tokens": 260, "output_tokens": 5, "cached_tokens": 0}]      # 249 -> 15 lost
    bins = removals_by_progress([{"rounds": rounds}], 16, bins=3)
    assert bins == [0, 9, 15]  # progress 1/3, 2/3, 1: bins (0, 1/3], (1/3, 2/3], (2/3, 1]
    assert removals_by_progress([{"rounds": rounds[:1]}], 16) == [0] * 10


def test_yardstick_reports_the_best_cap_beside_mars(grid):
    _exp, out, record = grid
    rows = record["yardstick"]
    assert [(r["key"], r["kind"]) for r in rows] == [("compact/rps1/seed0", "fcfs-cap"),
                                                       ("compact/rps8/seed0", "fcfs-cap")]
    for r, c in zip(rows, record["cells"]):
        sweep = {cap: c["policies"][f"fcfs-cap{cap}"]["mean_e2e_s"] for cap in (1, 2)}
        assert r["best_cap"] == min(sweep, key=sweep.get) and r["edge"]
        assert r["mars_over_best_cap"] == pytest.approx(sweep[r["best_cap"]] / c["policies"]["mars"]["mean_e2e_s"])
        assert not c["baseline"].startswith("fcfs-cap")  # a hindsight-tuned cap is no baseline
    table = (out / "table.md").read_text()
    assert "## Admission yardstick" in table and "## P90 E2E (s), per policy" in table


def test_yardstick_over_seeds_reads_one_cap_for_every_seed():
    from vllm_mars.experiment.yardstick import format_yardstick, yardstick_seed_rows

    def row(seed, mars, sweep):
        best = min(sweep, key=sweep.get)
        return {"key": f"w/rps1/seed{seed}", "workload": "w", "rps": 1.0, "seed": seed, "kind": "mars-cap",
                "best_cap": int(best), "best_label": f"mars-cap{best}", "best_mean_e2e_s": sweep[best],
                "edge": False, "caps": [int(k) for k in sweep], "sweep": sweep, "mars_mean_e2e_s": mars,
                "mars_over_best_cap": sweep[best] / mars, "baseline": "fcfs", "baseline_mean_e2e_s": 900.0,
                "share_beyond_cap": None}

    # cap 20 is best on average (410 vs 415) although seed 1's own best is 16; cap 24 ran on seed 0 only
    rows = [row(0, 400.0, {"16": 430.0, "20": 400.0, "24": 500.0}), row(1, 420.0, {"16": 400.0, "20": 420.0})]
    (r,) = yardstick_seed_rows(rows)
    assert r["caps"] == ["16", "20"] and r["best_cap"] == 20 and r["best_mean_e2e_s"] == 410.0
    assert r["per_seed"] == [1.0, 1.0] and r["mars_over_best_cap"] == pytest.approx(1.0)
    assert r["mars_over_own_best_min"] == pytest.approx(400 / 420)
    assert "### Over seeds" in format_yardstick(rows)
    assert yardstick_seed_rows(rows[:1]) == []  # one seed: no interval


def test_cap_controller_admits_in_arrival_order_up_to_the_cap():
    from vllm_mars.admission.base import PendingRoot, make_controller

    c = make_controller("cap", {"cap": 2})
    for i in range(4):
        c.offer(PendingRoot(f"r{i}", float(i)))
    assert c.tick(4.0) == ["r0", "r1"] and c.tick(4.2) == []
    c.finish("r1", 5.0)
    assert c.tick(5.0) == ["r2"] and c.num_active == 2 and c.num_queued == 1
    with pytest.raises(ValueError, match="cap"):
        make_controller("cap", {"cap": 0})
    with pytest.raises(ValueError, match="window_max"):
        make_controller("cap", {"window_max": 4})


def test_figures_key_is_checked(tmp_path):
    from vllm_mars.experiment.spec import ExperimentError, load_experiment

    (tmp_path / "e.toml").write_text(GRID.replace('figures = "all"', 'figures = ["e2e", "fig99"]'))
    with pytest.raises(ExperimentError, match=r"figures: 'fig99' unknown; allowed: e2e, throughput_goodput"):
        load_experiment(tmp_path / "e.toml")


def test_the_yardstick_is_known_by_name_exactly_where_the_driver_runs_the_static_cap():
    from vllm_mars.driver.control import _SPECIAL, resolve_policy
    from vllm_mars.metrics.compare import is_baseline, is_yardstick
    from vllm_mars.policies import available_policies

    names = set(_SPECIAL) | set(available_policies())
    assert {n for n in names if resolve_policy(n).controller == "cap"} == {n for n in names if is_yardstick(n)} \
        == {"fcfs-cap", "mars-cap"}
    assert not is_baseline("fcfs-cap") and is_baseline("fcfs")


def test_red_speedup_compares_the_seeds_both_policies_ran(tmp_path, monkeypatch):
    """fcfs and the ablation ran seed 0 only, mars and continuum seeds 0-2: a seed-mean ratio would
    divide fcfs's seed 0 (8 s) by mars's three-seed mean (6.67 s) = 1.20x; per seed over the
    baselines that ran it it is (8/10 + 20/5 + 20/5) / 3 = 2.93x, table.md's over-seeds speedup."""
    from types import SimpleNamespace

    from vllm_mars.experiment import figures
    from vllm_mars.metrics.report import _plt

    e2e = {0: {"mars": 10.0, "fcfs": 8.0, "continuum": 12.0, "mars-no-admission": 15.0},
           1: {"mars": 5.0, "continuum": 20.0}, 2: {"mars": 5.0, "continuum": 20.0}}
    cells = [{"workload": "w", "rps": 0.5, "seed": s, "policies": {
        p: {"mean_e2e_s": v, "p90_e2e_s": 2 * v, "p95_e2e_s": 3 * v} for p, v in by.items()}}
        for s, by in e2e.items()]
    exp = SimpleNamespace(policies=["mars", "fcfs", "continuum", "mars-no-admission"], variants={},
                          workloads=[SimpleNamespace(name="w")])
    for stat in ("mean", "p90", "p95"):
        assert figures.seed_speedup(exp, cells, "w", 0.5, figures._e2e(stat)) == pytest.approx(8.8 / 3)
    drawn = []
    monkeypatch.setattr(figures, "_save", lambda fig, path, plt: drawn.append(
        ([t.get_text() for ax in fig.axes for t in ax.texts],
         [b.get_height() for ax in fig.axes for b in ax.patches if b.get_height()])) or plt.close(fig))
    plt = _plt()
    figures.fig_e2e(plt, exp, cells, tmp_path / "e2e.png")
    figures.fig_ablations(plt, exp, cells, tmp_path / "abl.png")
    assert drawn[0][0] == ["2.93x", "2.93x", "2.93x"]
    assert drawn[1][1] == [pytest.approx(1.5)]  # the ablation ran seed 0 only: 15 / 10, not 15 / 6.67
