"""The no-thrash limit in the experiment report: the gap-closed computation on a hand-made pair of
results, matching by cell and workload, the ``limit`` key / ``--limit`` / ``mars experiment gap``,
and the shipped no-thrash limit (paper_grid_nothrash_kernels: every run free of preemptions and
evictions)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from vllm_mars.experiment.limit import MIN_GAP, gap_closed, limit_rows, load_limit

REPO = Path(__file__).resolve().parents[1]


def _run(mean: float, done: int = 10, preempt: int = 0, evicted: int = 0) -> dict:
    return {"mean_e2e_s": mean, "completed": done, "workflows": 10, "preemptions": preempt,
            "kv_blocks_removed": evicted}


def _record(name: str, cells: list[tuple[str, float, dict[str, dict], str | None]], n: int = 10) -> dict:
    """A results.json of workload W (preset ILR-4, ``n`` workflows) with the given cells."""
    return {"experiment": name, "config": {
        "workloads": [{"name": "W", "preset": "ILR-4", "path": None, "weka": None, "scale": None,
                       "max_context": None, "max_tool_s": None, "num_workflows": n, "arrival": None}],
        "replay": {"backend": "sim", "profile": "h200-qwen3-coder-30b-a3b", "arrival": "poisson",
                   "num_workflows": None, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                   "max_model_len": 262144}},
        "cells": [{"key": f"W/rps{rps:g}/seed0", "workload": "W", "rps": rps, "seed": 0, "policies": pols,
                   "baseline": base} for _, rps, pols, base in cells]}


GRID = _record("grid", [
    ("W", 0.02, {"mars": _run(500.0), "fcfs": _run(900.0), "infercept": _run(800.0)}, "infercept"),
    ("W", 0.04, {"mars": _run(1700.0), "fcfs": _run(1800.0), "infercept": _run(1500.0)}, "infercept"),
    ("W", 0.01, {"mars": _run(400.0), "fcfs": _run(401.0)}, "fcfs"),
    ("W", 0.005, {"mars": _run(380.0), "fcfs": _run(381.0)}, "fcfs"),
])
LIMIT = _record("limit", [
    ("W", 0.02, {"fcfs": _run(400.0), "mars": _run(350.0, done=9)}, None),   # mars left out: 9/10 done
    ("W", 0.04, {"fcfs": _run(500.0)}, None),
    ("W", 0.01, {"fcfs": _run(399.0)}, None),                                  # 0.5 % gap: no gap
])


def test_gap_closed_is_the_share_of_baseline_minus_limit_that_mars_recovers():
    assert gap_closed(800.0, 500.0, 400.0) == pytest.approx(0.75)
    assert gap_closed(1500.0, 1700.0, 500.0) == pytest.approx(-0.2)
    assert gap_closed(800.0, 400.0, 400.0) == pytest.approx(1.0)
    assert gap_closed(401.0, 400.0, 399.0) is None, f"a gap under {MIN_GAP:.0%} of the limit is no gap"
    assert gap_closed(390.0, 380.0, 400.0) is None and gap_closed(None, 1.0, 1.0) is None


def test_limit_rows_match_cells_and_workloads_and_take_the_fastest_complete_limit_run():
    rows, notes = limit_rows(GRID, LIMIT)
    assert [r["key"] for r in rows] == ["W/rps0.02/seed0", "W/rps0.04/seed0", "W/rps0.01/seed0"]  # 0.005: no limit
    r = rows[0]
    assert (r["limit_policy"], r["limit_mean_e2e_s"], r["baseline"]) == ("fcfs", 400.0, "infercept")
    assert r["gap_closed"] == pytest.approx(0.75) and r["mars_over_limit"] == pytest.approx(1.25)
    assert rows[1]["gap_closed"] == pytest.approx(-0.2) and rows[2]["gap_closed"] is None
    assert notes == []
    # another workflow count is another workload: no row, a note that says why
    rows, notes = limit_rows(GRID, _record("limit", [("W", 0.02, {"fcfs": _run(400.0)}, None)], n=20))
    assert rows == [] and notes == [("W/rps0.02/seed0: not the same workload as the limit's "
                                     "(num_workflows 10 vs 20)")]


def test_report_and_gap_command_state_the_limit(tmp_path, capsys):
    from vllm_mars.cli import main
    from vllm_mars.experiment.limit import format_limit

    grid, lim = tmp_path / "grid.json", tmp_path / "limit.json"
    grid.write_text(json.dumps(GRID))
    lim.write_text(json.dumps(LIMIT))
    text = "\n".join(format_limit(*limit_rows(GRID, LIMIT), "`limit.json`"))
    assert "| W | 0.02 | 0 | 400.00 | fcfs | 0 / 0 | infercept | 800.00 | 500.00 | 2.00x | 1.25x | 0.75 |" in text
    assert "| W | 0.01 | 0 | 399.00 | fcfs | 0 / 0 | fcfs | 401.00 | 400.00 | 1.01x | 1.00x | - |" in text
    thrashed = copy.deepcopy(LIMIT)
    thrashed["cells"][1]["policies"]["fcfs"]["preemptions"] = 3
    assert "| 3 / 0 ! |" in "\n".join(format_limit(*limit_rows(GRID, thrashed), "x"))
    assert main(["experiment", "gap", str(grid), str(lim)]) == 0
    assert "| 0.75 |" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cells": [{"key": 3}], "config": {}}))
    assert main(["experiment", "gap", str(grid), str(bad)]) == 2
    assert capsys.readouterr().err.strip().endswith("bad.json: cells[0]: needs 'key' and 'policies'")


@pytest.mark.parametrize("value, text", [
    ('"nope/results.json"', "not found"),
    ('"exp.toml"', "not JSON"),
    ("3", "expected a non-empty string"),
])
def test_a_bad_limit_in_the_file_is_a_one_line_error(tmp_path, capsys, value, text):
    from vllm_mars.cli import main
    from vllm_mars.experiment.spec import ExperimentError, load_experiment

    src = (REPO / "experiments" / "studies" / "paper_grid_nothrash_kernels.toml").read_text()
    path = tmp_path / "exp.toml"
    path.write_text(f"limit = {value}\n" + src)
    with pytest.raises(ExperimentError) as e:
        load_experiment(path)
    assert str(e.value).startswith(f"{path}: limit: ") and text in str(e.value) and "\n" not in str(e.value)
    assert main(["experiment", "run", str(REPO / "experiments" / "studies" / "paper_grid_nothrash_kernels.toml"),
                 "--limit", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")]) == 2
    assert "--limit: " in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.parametrize(("paper_file", "limit_file", "seeds"), [
    # the paper grid (seed 0) and its seed study (seeds 1-2) on the measured-kernel profile, and their
    # limit (seeds 0-2) on the same profile
    ("paper_grid", "paper_grid_nothrash_kernels", (0, 1, 2)),
    ("paper_grid_seeds", "paper_grid_nothrash_kernels", (0, 1, 2)),
])
def test_shipped_nothrash_limit_matches_the_paper_grid_and_never_thrashed(paper_file, limit_file, seeds):
    from vllm_mars.experiment.spec import load_experiment

    studies, results = REPO / "experiments" / "studies", REPO / "experiments" / "results"
    paper = load_experiment(studies / f"{paper_file}.toml")
    nothrash = load_experiment(studies / f"{limit_file}.toml")
    assert paper.limit == (results / limit_file / "results.json").resolve()
    assert nothrash.base.profile == paper.base.profile
    assert nothrash.policies == ("fcfs",) and nothrash.base.kv_scale == 10.0 and nothrash.seeds == seeds
    cells = {c.key for c in nothrash.cells() if c.seed in paper.seeds}
    want = {"ILR-3/rps0.08", "ILR-3/rps0.16", "ILR-4/rps0.02", "ILR-4/rps0.04", "ILR-4/rps0.08"}
    assert cells == {f"{k}/seed{s}" for k in want for s in paper.seeds}
    assert cells <= {c.key for c in paper.cells()}
    pw = {w.name: w for w in paper.workloads}
    for w in nothrash.workloads:
        assert (w.preset, w.num_workflows, w.scale, w.arrival) == (pw[w.name].preset, pw[w.name].num_workflows,
                                                                    pw[w.name].scale, pw[w.name].arrival)
    lim = load_limit(paper.limit)
    for c in lim["cells"]:
        d = c["policies"]["fcfs"]
        assert d["completed"] == d["workflows"] and d["preemptions"] == 0 and d["kv_blocks_removed"] == 0, c["key"]
    rows, notes = limit_rows(load_limit(results / paper_file / "results.json"), lim)
    assert len(rows) == len(cells) and notes == [] and all(r["limit_mean_e2e_s"] for r in rows)


def test_the_experiment_report_carries_the_limit_section(tmp_path):
    from dataclasses import replace

    from vllm_mars.experiment.results import write_results
    from vllm_mars.experiment.spec import load_experiment

    exp = load_experiment(REPO / "experiments" / "studies" / "paper_grid_nothrash_kernels.toml")
    lim_path = REPO / "experiments" / "results" / "paper_grid_nothrash_kernels" / "results.json"
    lim = load_limit(lim_path)
    record = write_results(replace(exp, limit=lim_path), tmp_path, lim["cells"], None)
    assert [r["key"] for r in record["limit"]["cells"]] == [c["key"] for c in lim["cells"]]
    assert record["limit"]["file"] == "../results/paper_grid_nothrash_kernels/results.json"  # relative to the file
    table = (tmp_path / "table.md").read_text()
    assert "## Gap to the no-thrash limit" in table and "`../results/paper_grid_nothrash_kernels/results.json`" in table
    assert "No `mars` run in this experiment" in table and not (tmp_path / "speedup_heatmap.png").exists()
    assert json.loads((tmp_path / "results.json").read_text())["limit"]["cells"][0]["limit_policy"] == "fcfs"


def test_summary_pools_cells_of_several_files_against_the_fastest_baseline_and_mars(tmp_path, capsys):
    from vllm_mars.cli import main
    from vllm_mars.experiment.summary import policy_summary

    def run(mean: float, goodput: float) -> dict:
        return {"mean_e2e_s": mean, "goodput_wps_alpha3.0": goodput}

    a = _record("a", [("W", 0.02, {"mars": run(100.0, 0.5), "mars-x": run(100.0, 0.5), "fcfs": run(200.0, 0.2),
                                   "infercept": run(110.0, 0.6)}, "infercept")])
    b = _record("b", [("W", 0.04, {"mars": run(120.0, 0.3), "mars-x": run(100.0, 0.3), "fcfs": run(108.0, 0.3)},
                       "fcfs")])
    rows = {r["policy"]: r for r in policy_summary([a, b])}
    m, x = rows["mars"], rows["mars-x"]
    assert m["cells"] == 2 and m["geomean"] == pytest.approx((1.1 * 0.9) ** 0.5)
    assert m["lowest"] == pytest.approx(0.9) and m["lowest_cell"] == "b:W/rps0.04/seed0" and m["below"] == 1
    assert m["goodput_below"] == 1 and "ref" not in m  # 0.5 < 0.99 x 0.6 in cell a
    assert x["ref_geomean"] == pytest.approx(1.2 ** 0.5) and x["identical"] == 1 and x["ref_max"] == pytest.approx(1.2)
    # paired over its two cells (1.0x, 1.2x): the 95 % interval of the mean log ratio (t with 1 df)
    half = 12.706 * math.log(1.2) / 2
    assert x["ref_low"] == pytest.approx(1.2 ** 0.5 * math.exp(-half), rel=1e-3)
    assert x["ref_high"] == pytest.approx(1.2 ** 0.5 * math.exp(half), rel=1e-3)
    # only fcfs as the baseline, one cell
    only = policy_summary([a, b], baselines=["fcfs"], only=["a:*"])
    assert [r["policy"] for r in only] == ["mars", "mars-x"] and only[0]["geomean"] == pytest.approx(2.0)
    # a variant of mars under another name is mars, not a baseline, as in the experiment's table
    v = copy.deepcopy(a)
    v["cells"][0]["policies"]["fast"] = run(50.0, 0.9)
    v["config"]["variants"] = {"fast": {"policy": "mars"}}
    rows = {r["policy"]: r for r in policy_summary([v])}
    assert rows["fast"]["geomean"] == pytest.approx(2.2) and rows["mars"]["geomean"] == pytest.approx(1.1)
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    assert main(["experiment", "summary", str(fa), str(fb)]) == 0
    out = capsys.readouterr().out
    assert "| mars | 2 | 0.9950x | 0.9000x (b:W/rps0.04/seed0) | 1 | 1 | - | - |" in out, out
    assert "| 1 of 2 |" in out
    assert main(["experiment", "summary", str(fa), "--only", "nope/*"]) == 2
    assert "no mars policy" in capsys.readouterr().err


def _gp(mean: float, goodput: float) -> dict:
    return {"mean_e2e_s": mean, "goodput_wps_alpha3.0": goodput}


def _merge_pair() -> tuple[dict, dict]:
    """A baselines file (grid: mars, fcfs, infercept) and a variant-only file (var: mars and ``fast``,
    a labelled variant of mars) of the same cell and setup."""
    grid = _record("grid", [("W", 0.02, {"mars": _gp(100.0, 0.5), "fcfs": _gp(200.0, 0.2),
                                         "infercept": _gp(150.0, 0.6)}, "infercept")])
    var = _record("var", [("W", 0.02, {"mars": _gp(100.0, 0.5), "fast": _gp(75.0, 0.9)}, None)])
    var["config"]["variants"] = {"fast": {"policy": "mars"}}
    for rec in (grid, var):
        rec["cells"][0]["roots"] = 10
    return grid, var


def test_summary_merge_compares_a_variant_in_one_file_with_the_baselines_of_another():
    from vllm_mars.experiment.summary import merge_records, policy_summary

    grid, var = _merge_pair()
    apart = {r["policy"]: r for r in policy_summary([grid, var])}
    assert "geomean" not in apart["fast"] and apart["fast"]["cells"] == 0  # no baseline in var's cell
    merged, notes = merge_records([grid, var])
    assert notes == [] and [r["experiment"] for r in merged] == ["grid+var"]
    assert list(merged[0]["cells"][0]["policies"]) == ["mars", "fcfs", "infercept", "fast"]
    rows = {r["policy"]: r for r in policy_summary(merged)}
    f, m = rows["fast"], rows["mars"]
    assert f["cells"] == 1 and f["geomean"] == pytest.approx(2.0) and f["lowest_cell"] == "grid+var:W/rps0.02/seed0"
    assert f["goodput_below"] == 0 and f["ref_geomean"] == pytest.approx(100.0 / 75.0)
    # fast keeps var's driver policy (mars): not a baseline, so mars is still 1.5x over infercept
    assert m["cells"] == 1 and m["geomean"] == pytest.approx(1.5)
    # --only matches KEY, the merged name and each file's EXPERIMENT:KEY
    for glob in ("W/*", "grid+var:*", "var:*", "grid:W/rps0.02/*"):
        sel = {r["policy"]: r for r in policy_summary(merged, only=[glob])}
        assert sel["fast"]["geomean"] == pytest.approx(2.0), glob
    assert policy_summary(merged, only=["other:*"]) == []
    # a cell only one file has stays that file's EXPERIMENT:KEY
    alone = copy.deepcopy(var)
    alone["cells"][0]["key"] = "W/rps0.04/seed0"
    merged, _ = merge_records([grid, var, alone])
    assert [r["experiment"] + ":" + r["cells"][0]["key"] for r in merged] == [
        "grid+var:W/rps0.02/seed0", "var:W/rps0.04/seed0"]


@pytest.mark.parametrize("change, why", [
    (lambda r: r["config"]["replay"].update(profile="h100-qwen3-32b"),
     "profile differs ('h200-qwen3-coder-30b-a3b' vs 'h100-qwen3-32b')"),
    (lambda r: r["config"]["replay"].update(kv_scale=10.0), "kv_scale differs (None vs 10.0)"),
    (lambda r: r["config"]["workloads"][0].update(num_workflows=20), "num_workflows differs (10 vs 20)"),
    (lambda r: r["cells"][0].update(roots=9), "roots differs (10 vs 9)"),
    (lambda r: r["config"].update(workloads=[]), "workload not described in config.workloads"),
])
def test_summary_merge_keeps_cells_of_another_setup_apart_with_a_note(change, why):
    from vllm_mars.experiment.summary import merge_records, policy_summary

    grid, var = _merge_pair()
    change(var)
    merged, notes = merge_records([grid, var])
    assert notes == [f"W/rps0.02/seed0 in grid and var not merged: {why}"]
    assert [r["experiment"] for r in merged] == ["grid", "var"]
    assert "geomean" not in {r["policy"]: r for r in policy_summary(merged)}["fast"]
    assert merge_records([grid, var], only=["X/*"])[1] == []  # notes only on the selected cells
    assert merge_records([grid, var], only=["var:*"])[1] == notes


def test_summary_merge_takes_a_label_in_two_files_from_the_first_and_notes_other_numbers():
    from vllm_mars.experiment.summary import merge_records, policy_summary

    grid, var = _merge_pair()
    var["cells"][0]["policies"]["mars"] = _gp(110.0, 0.5)
    merged, notes = merge_records([grid, var])
    assert notes == ["W/rps0.02/seed0: mars has mean E2E 100.0 s in grid and 110.0 s in var: grid's taken"]
    assert merged[0]["cells"][0]["policies"]["mars"]["mean_e2e_s"] == 100.0
    assert {r["policy"]: r for r in policy_summary(merged)}["fast"]["ref_geomean"] == pytest.approx(100.0 / 75.0)
    merged, notes = merge_records([var, grid])
    assert notes == ["W/rps0.02/seed0: mars has mean E2E 110.0 s in var and 100.0 s in grid: var's taken"]
    assert merged[0]["experiment"] == "var+grid"
    assert {r["policy"]: r for r in policy_summary(merged)}["mars"]["geomean"] == pytest.approx(150.0 / 110.0)
    # the same numbers (to 1e-9) are no note; a baseline only in the second file is still compared
    var["cells"][0]["policies"]["mars"] = _gp(100.0 * (1 + 1e-12), 0.5)
    var["cells"][0]["policies"]["autellix"] = _gp(60.0, 0.7)
    merged, notes = merge_records([grid, var])
    assert notes == []
    assert {r["policy"]: r for r in policy_summary(merged)}["fast"]["geomean"] == pytest.approx(0.8)


def test_summary_merge_on_the_command_line(tmp_path, capsys):
    from vllm_mars.cli import main

    grid, var = _merge_pair()
    other = copy.deepcopy(var)
    other["experiment"] = "h100"
    other["config"]["replay"]["profile"] = "h100-qwen3-32b"
    files = []
    for rec in (grid, var, other):
        files.append(tmp_path / f"{rec['experiment']}.json")
        files[-1].write_text(json.dumps(rec))
    assert main(["experiment", "summary", str(files[0]), str(files[1])]) == 0
    out = capsys.readouterr().out
    assert "| fast | 0 | - | - | - | - | 1.3333x (1.3333 - 1.3333) vs mars | 0 of 1 |" in out and "note:" not in out
    assert main(["experiment", "summary", "--merge", str(files[0]), str(files[1]), str(files[2])]) == 0
    out = capsys.readouterr().out
    assert ("| fast | 1 | 2.0000x | 2.0000x (grid+var:W/rps0.02/seed0) | 0 | 0 | 1.3333x [1.3333 - 1.3333] (1.3333 - 1.3333) vs mars "
            "| 0 of 2 |") in out, out
    assert out.rstrip().endswith("note: W/rps0.02/seed0 in grid and h100 not merged: profile differs "
                                 "('h200-qwen3-coder-30b-a3b' vs 'h100-qwen3-32b')"), out


def _seeded(name: str, seeds: dict[int, tuple[float, float]], rps: float = 0.02) -> dict:
    """A results.json of workload W with one cell per seed: seed -> (mars, fcfs) mean E2E; each seed's
    cell has its own number of roots, as a sampled workload does."""
    rec = _record(name, [])
    rec["cells"] = [{"key": f"W/rps{rps:g}/seed{s}", "workload": "W", "rps": rps, "seed": s, "roots": 5 + s,
                     "policies": {"mars": _gp(m, 0.5 if m <= f else 0.48 - 0.001 * s),
                                  "fcfs": _gp(f, 0.5)}, "baseline": "fcfs"}
                    for s, (m, f) in seeds.items()]
    return rec


def test_summary_judges_each_load_level_over_its_seeds_across_files(tmp_path, capsys):
    from vllm_mars.cli import main
    from vllm_mars.experiment.summary import mean_interval, merge_records, policy_summary, seed_interval

    # behind in every seed at rps 0.02 (two files, seeds 0 | 1-2); mixed at rps 0.04 (seed 0 only in
    # the first file, seeds 1-2 in the second)
    a = _seeded("a", {0: (104.0, 100.0)})
    a["cells"] += _seeded("a", {0: (96.0, 100.0)}, rps=0.04)["cells"]
    b = _seeded("b", {1: (105.0, 100.0), 2: (103.0, 100.0)})
    b["cells"] += _seeded("b", {1: (110.0, 100.0), 2: (97.0, 100.0)}, rps=0.04)["cells"]
    gm, lo, hi = seed_interval([100 / 104, 100 / 105, 100 / 103])
    assert gm == pytest.approx((100 ** 3 / (104 * 105 * 103)) ** (1 / 3)) and lo < gm < hi < 1.0
    for records in ([a, b], merge_records([a, b])[0]):
        m = policy_summary(records)[0]
        assert m["seed_groups"] == 2 and m["seed_behind"] == 1, m
        assert m["seed_worst"]["group"] == "W/rps0.02" and m["seed_worst"]["seeds"] == 3
        assert m["seed_worst"]["high"] == pytest.approx(hi)
        # goodput: 0.020-0.022 below fcfs's in every seed at rps 0.02 (behind); 0.021 below in one of the
        # three at rps 0.04 (within noise)
        assert m["seed_goodput_behind"] == 1
        assert m["seed_worst"]["goodput_diff"] == pytest.approx(-0.021)
    # a cell of another setup is no seed of the group
    c = _seeded("c", {3: (90.0, 100.0)})
    c["config"]["replay"]["max_num_seqs"] = 64
    assert policy_summary([a, b, c])[0]["seed_worst"]["seeds"] == 3
    # one seed only: no interval
    assert "seed_groups" not in policy_summary([a])[0]
    with pytest.raises(ValueError, match="two or more"):
        seed_interval([1.0])
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    assert main(["experiment", "summary", str(fa), str(fb), "--groups"]) == 0
    out = capsys.readouterr().out
    assert "| 1 of 2 | W/rps0.02 (3 seeds): " in out, out
    assert f"| mars | W/rps0.02 | 3 | {gm:.4f}x | {lo:.4f} - {hi:.4f} | behind | -0.02100 |" in out
    dg, dlo, dhi = mean_interval([-0.020, -0.021, -0.022])
    assert dg == pytest.approx(-0.021)
    assert dhi < 0 and f"| {dlo:+.5f} - {dhi:+.5f} | behind |" in out
    row = next(line for line in out.splitlines() if line.startswith("| mars | 6 |"))
    assert row.endswith(f"| 1 of 2 | W/rps0.02 (3 seeds): {gm:.4f}x [{lo:.4f} - {hi:.4f}] | 1 of 2 |"), row
    assert "| mars | W/rps0.04 | 3 |" in out and "| within noise |" in out


def test_summary_notes_cells_pooled_from_several_profiles(tmp_path, capsys):
    from vllm_mars.cli import main
    from vllm_mars.experiment.summary import profile_notes

    a = _record("a", [("W", 0.02, {"mars": _gp(100.0, 0.5), "fcfs": _gp(200.0, 0.2)}, "fcfs")])
    b = _record("b", [("W", 0.04, {"mars": _gp(100.0, 0.5), "fcfs": _gp(120.0, 0.2)}, "fcfs")])
    assert profile_notes([a, b]) == []
    b["config"]["replay"]["profile"] = "h200-qwen3-coder-30b-a3b-kernels"
    (note,) = profile_notes([a, b])
    assert "2 profiles" in note and "sim:h200-qwen3-coder-30b-a3b (a)" in note
    assert "sim:h200-qwen3-coder-30b-a3b-kernels (b)" in note
    assert profile_notes([a, b], only=["a:*"]) == []  # b's cells are not selected
    fa, fb = tmp_path / "a.json", tmp_path / "b.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    assert main(["experiment", "summary", str(fa), str(fb)]) == 0
    assert f"note: {note}" in capsys.readouterr().out
    assert main(["experiment", "summary", str(fa), str(fb), "--merge"]) == 0
    assert f"note: {note}" in capsys.readouterr().out
