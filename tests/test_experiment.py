"""``mars experiment run``: a 2-cell grid on the virtual-time engine, resumability, validation."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPACT = REPO / "benchmark" / "workloads" / "compact.jsonl"
PROFILE = "h200-qwen3-coder-30b-a3b"

GRID = f"""
name = "two-cells"
description = "compact x 2 rps on the sim"
backend = "sim"
profile = "{PROFILE}"
arrival = "fixed"
num_workflows = 3
policies = ["mars", "fcfs", "mars-short-ret"]

[variants.mars-short-ret]
policy = "mars"
policy_options = {{ max_retention_s = 0.5 }}

[[workloads]]
name = "compact"
path = "{COMPACT}"
rps = [2, 8]
"""


def write(tmp_path: Path, text: str, name: str = "exp.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _recording_replay(ran: list):
    """A stand-in for ``run_replay`` that records (policy, rps) and writes a summary with mean E2E 1 s."""

    def one(cfg, cost=None):
        ran.append((cfg.policy, cfg.rps))
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        Path(cfg.out, "summary.json").write_text(json.dumps({"policy": cfg.policy, "e2e_s": {"mean": 1.0}}))
        return Path(cfg.out), cost

    return one


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from vllm_mars.experiment.grid import run_experiment
    from vllm_mars.experiment.spec import load_experiment

    d = tmp_path_factory.mktemp("experiment")
    exp = load_experiment(write(d, GRID))
    record = run_experiment(exp, d / "out", progress=False)
    return exp, d / "out", record


def test_two_cell_grid_runs_every_policy_and_writes_the_table(grid):
    exp, out, record = grid
    assert [c["key"] for c in record["cells"]] == ["compact/rps2/seed0", "compact/rps8/seed0"]
    assert record["missing"] == []
    for c in record["cells"]:
        d = out / "runs" / "compact" / f"rps{c['rps']:g}" / "seed0"
        summaries = {p: json.loads((d / p / "summary.json").read_text()) for p in exp.policies}
        for p, s in summaries.items():
            assert s["completed"] == 3 and s["errors"] == 0, p
            assert s["backend"] == "sim" and s["engine"]["leak_check"] == "ok", p  # the sim's leak check
        # the variant ran the mars driver policy with its option; it is mars, not a baseline
        rc = json.loads((d / "mars-short-ret" / "run_config.json").read_text())
        assert rc["policy"] == "mars" and rc["policy_options"] == {"max_retention_s": 0.5}
        assert rc["profile"] == PROFILE and rc["plots"] is False
        assert summaries["mars-short-ret"]["controller"] == "mars"
        assert c["baseline"] == "fcfs"
        assert c["speedup"] == pytest.approx(summaries["fcfs"]["e2e_s"]["mean"] / summaries["mars"]["e2e_s"]["mean"])
        assert c["policies"]["mars"]["goodput_wps_alpha3.0"] == summaries["mars"]["goodput_wps"]["3.0"]
        assert c["policies"]["fcfs"]["p95_e2e_s"] == summaries["fcfs"]["e2e_s"]["p95"]
        assert c["policies"]["mars"]["kv_usage_max"] == summaries["mars"]["kv_usage"]["max"] > 0
        assert c["policies"]["mars"]["mean_tool_wait_s"] == summaries["mars"]["tools"]["mean_wait_s"] == 0  # no cpu_tool
    # one T_ideal cost model for the whole grid, from the sim's calibration
    cost = json.loads((out / "cost_model.json").read_text())
    assert record["cost_model"] == cost and cost["prefill_s_per_token"] > 0
    table = (out / "table.md").read_text()
    assert "| compact | 8 | 0 |" in table and "fastest baseline" in table and "mars-short-ret" in table
    assert "| adm. wait (s) | tool wait (s) | KV | mean TTFT (s) |" in table
    for png in ("speedup_heatmap.png", "mean_e2e_vs_rps.png", "goodput_vs_rps.png"):
        assert (out / png).stat().st_size > 1000, png
    assert json.loads((out / "results.json").read_text())["cells"] == record["cells"]
    assert "run_dir" not in json.dumps(record["cells"])  # results.json carries no machine-local paths
    # each run's CPU time: in its run dir (not in summary.json: the sim's results stay its events'
    # alone), per run in results.json, summed in the header and per run in the mechanisms table
    cpu, imported = [], []
    for c in record["cells"]:
        d = out / "runs" / "compact" / f"rps{c['rps']:g}" / "seed0"
        for p in exp.policies:
            usage = json.loads((d / p / "usage.json").read_text())
            assert usage["cpu_s"] > 0 and usage["wall_s"] > 0 and usage["cpu_s"] >= usage["children_cpu_s"], p
            assert c["policies"][p]["cpu_s"] == usage["cpu_s"]
            assert c["policies"][p]["cpu_imported_vllm"] is usage["imported_vllm"]
            assert "cpu" not in (d / p / "summary.json").read_text()
            cpu.append(usage["cpu_s"])
            imported.append(usage["imported_vllm"])
    assert record["cpu_s"] == round(sum(cpu), 1) and record["cpu_runs"] == 6
    assert sum(imported) <= 1 and not any(imported[1:])  # only a process's first run loads vLLM
    assert f"CPU time of the runs, summed: {record['cpu_s']:.0f} s" in table
    assert "| mean TTFT (s) | CPU (s) |" in table


def test_second_run_skips_finished_cells_and_only_selects(grid, monkeypatch):
    from vllm_mars.driver import compare
    from vllm_mars.experiment.grid import run_experiment

    exp, out, record = grid

    def boom(*a, **k):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(compare, "run_replay", boom)
    again = run_experiment(exp, out, progress=False)
    assert again["cells"] == record["cells"]
    # a cell with one run missing runs only that run
    cell = out / "runs" / "compact" / "rps8" / "seed0"
    (cell / "fcfs" / "summary.json").unlink()
    (cell / "cell.json").unlink()
    ran = []
    monkeypatch.setattr(compare, "run_replay", _recording_replay(ran))
    # --policies: run only some now; the cell reports every finished run and lists what is left
    part = run_experiment(exp, out, only=["compact/rps8/*"], progress=False, policies=["mars-short-ret"])
    assert ran == [] and part["missing_runs"] == ["compact/rps8/seed0/fcfs"]
    partial = {c["key"]: c for c in part["cells"]}["compact/rps8/seed0"]
    assert set(partial["policies"]) == {"mars", "mars-short-ret"} and partial["speedup"] is None
    assert run_experiment(exp, out, progress=False, execute=False)["missing_runs"] == ["compact/rps8/seed0/fcfs"]
    rec = run_experiment(exp, out, only=["compact/rps8/*"], progress=False)
    assert ran == [("fcfs", 8.0)] and rec["missing_runs"] == []
    fresh = {c["key"]: c for c in rec["cells"]}["compact/rps8/seed0"]
    assert fresh["baseline"] == "fcfs" and fresh["policies"]["fcfs"]["mean_e2e_s"] == 1.0
    # --rerun: a finished run is deleted and run again (the others in the cell are read)
    ran.clear()
    (out / "runs" / "compact" / "rps2" / "seed0" / "mars-short-ret" / "stale.txt").write_text("x")
    rec = run_experiment(exp, out, only=["compact/rps2/*"], progress=False, rerun=["mars-short-ret"],
                         policies=["fcfs"])
    assert ran == [("mars", 2.0)]  # the variant's policy
    d2 = out / "runs" / "compact" / "rps2" / "seed0" / "mars-short-ret"
    assert not (d2 / "stale.txt").exists()
    assert {c["key"]: c for c in rec["cells"]}["compact/rps2/seed0"]["policies"]["mars-short-ret"]["mean_e2e_s"] == 1.0
    with pytest.raises(ValueError, match="--rerun: 'nope' is not a policy"):
        run_experiment(exp, out, progress=False, rerun=["nope"])


def test_runs_a_results_file_records_without_run_dirs_are_kept_and_joined_by_new_runs(grid, tmp_path, capsys,
                                                                                       monkeypatch):
    """A fresh clone has results.json but no run dirs: its recorded runs count as finished and stay in the
    table that a --policies, --only or --report run there writes, beside the runs it makes; the speedup is
    taken over both; --rerun runs a recorded one again."""
    import shutil

    from vllm_mars.cli import main
    from vllm_mars.driver import compare
    from vllm_mars.experiment.grid import run_experiment

    exp, out, _ = grid
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    before = {c["key"]: c for c in json.loads((copy / "results.json").read_text())["cells"]}
    shutil.rmtree(copy / "runs" / "compact" / "rps2" / "seed0" / "mars")  # one run's dir gone
    ran = []
    monkeypatch.setattr(compare, "run_replay", _recording_replay(ran))
    rec = run_experiment(exp, copy, progress=False, policies=["fcfs"])
    assert ran == [] and rec["missing_runs"] == [] and rec["missing"] == []
    cells = {c["key"]: c for c in rec["cells"]}
    assert cells["compact/rps2/seed0"]["policies"] == before["compact/rps2/seed0"]["policies"]
    assert cells["compact/rps2/seed0"]["speedup"] == pytest.approx(before["compact/rps2/seed0"]["speedup"])
    shutil.rmtree(copy / "runs")  # a fresh clone: every run dir gone
    assert main(["experiment", "run", str(exp.path), "--out", str(copy), "--report"]) == 0
    rec = json.loads((copy / "results.json").read_text())
    assert {c["key"]: c["policies"] for c in rec["cells"]} == {k: c["policies"] for k, c in before.items()}
    assert "Traceback" not in capsys.readouterr().err
    # a new run joins the recorded ones in its cell; the speedup is taken over both
    rec = run_experiment(exp, copy, only=["compact/rps8/*"], progress=False, rerun=["fcfs"])
    assert ran == [("fcfs", 8.0)]
    c8, old8 = {c["key"]: c for c in rec["cells"]}["compact/rps8/seed0"], before["compact/rps8/seed0"]
    assert c8["policies"]["fcfs"]["mean_e2e_s"] == 1.0 and c8["policies"]["mars"] == old8["policies"]["mars"]
    assert list(c8["policies"]) == ["mars", "fcfs", "mars-short-ret"]
    assert c8["baseline"] == "fcfs" and c8["speedup"] == pytest.approx(1.0 / old8["policies"]["mars"]["mean_e2e_s"])
    assert {c["key"]: c for c in rec["cells"]}["compact/rps2/seed0"]["policies"] == before["compact/rps2/seed0"]["policies"]
    # written again, nothing is counted twice
    again = run_experiment(exp, copy, progress=False, execute=False)
    assert ran == [("fcfs", 8.0)] and again["cells"] == rec["cells"] and again["wall_s"] == rec["wall_s"]
    # a run of a policy the file no longer runs (a variant removed or renamed) is not kept:
    # the file changed, and the rewritten table leaves it out
    data = json.loads((copy / "results.json").read_text())
    data["cells"][0]["policies"]["mars-renamed"] = dict(data["cells"][0]["policies"]["mars"])
    (copy / "results.json").write_text(json.dumps(data))
    rec = run_experiment(exp, copy, progress=False, execute=False)
    assert all("mars-renamed" not in c["policies"] for c in rec["cells"])

def test_report_without_run_dirs_redraws_the_table_from_results_json(grid, tmp_path, capsys):
    """A fresh clone has results.json and no run dirs: --report draws table.md and the plots again
    from results.json, which stays as recorded."""
    import shutil

    from vllm_mars.cli import main

    exp, out, _ = grid
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(out / "results.json", fresh)
    before = (fresh / "results.json").read_text()
    assert main(["experiment", "run", str(exp.path), "--out", str(fresh), "--report"]) == 0
    assert (fresh / "table.md").read_text() == (out / "table.md").read_text()
    assert (fresh / "results.json").read_text() == before and not (fresh / "runs").exists()
    for png in ("speedup_heatmap.png", "mean_e2e_vs_rps.png", "goodput_vs_rps.png"):
        assert (fresh / png).stat().st_size > 1000, png
    (fresh / "results.json").write_text(before.replace('"experiment": "two-cells"', '"experiment": "other"'))
    assert main(["experiment", "run", str(exp.path), "--out", str(fresh), "--report"]) == 2
    assert "results of experiment 'other', not of" in capsys.readouterr().err


def test_results_name_repo_files_by_repo_relative_paths(grid, tmp_path):
    """results.json and table.md are committed: an experiment file, workload or profile inside the
    repository is recorded relative to it, whatever path it was given by; one outside stays as given."""
    from vllm_mars.experiment.results import shown_path, write_results
    from vllm_mars.experiment.spec import load_experiment

    exp, _, record = grid  # its file is in a temporary dir, its workload in the repository
    assert record["config"]["file"] == str(exp.path)
    assert record["config"]["workloads"][0]["path"] == "benchmark/workloads/compact.jsonl"
    seeds = load_experiment(REPO / "experiments" / "studies" / "cpu_default_seeds.toml")
    rec = write_results(seeds, tmp_path, [], None)
    assert rec["config"]["file"] == "experiments/studies/cpu_default_seeds.toml"
    assert [w["path"] for w in rec["config"]["workloads"]] == ["benchmark/workloads/compact.jsonl"]
    text = (tmp_path / "results.json").read_text() + (tmp_path / "table.md").read_text()
    assert str(REPO) not in text and "- file: `experiments/studies/cpu_default_seeds.toml`" in text
    assert shown_path("fcfs") == "fcfs" and shown_path("/nonexistent/x.toml") == "/nonexistent/x.toml"


def test_run_cpu_time_is_the_runs_own_and_old_records_still_report(grid, tmp_path, monkeypatch):
    """usage.json counts the CPU a run took in this process and in the children it waited for, not
    its wall time; cells and results.json written before it existed still load and report."""
    import shutil
    import subprocess
    import sys
    import time

    from vllm_mars.driver import compare
    from vllm_mars.experiment.grid import run_experiment
    from vllm_mars.experiment.results import format_results

    def busy(seconds):
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    work = {"mars": lambda: busy(0.3), "fcfs": lambda: time.sleep(0.3),
            "mars-short-ret": lambda: subprocess.run(
                [sys.executable, "-c", "import time\nt=time.process_time()+0.3\nwhile time.process_time()<t: pass"],
                check=True)}

    def replay(cfg, cost=None):
        work[Path(cfg.out).name]()  # the run dir is the label
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        Path(cfg.out, "summary.json").write_text(json.dumps({"policy": cfg.policy, "e2e_s": {"mean": 1.0}}))
        return Path(cfg.out), cost

    exp, _, _ = grid
    monkeypatch.setattr(compare, "run_replay", replay)
    rec = run_experiment(exp, tmp_path / "o", only=["compact/rps2/*"], progress=False)
    d = tmp_path / "o" / "runs" / "compact" / "rps2" / "seed0"
    use = {p: json.loads((d / p / "usage.json").read_text()) for p in exp.policies}
    assert 0.28 <= use["mars"]["cpu_s"] < 1.5 and use["mars"]["children_cpu_s"] == 0
    assert use["fcfs"]["wall_s"] >= 0.3 and use["fcfs"]["cpu_s"] < 0.15
    assert use["mars-short-ret"]["children_cpu_s"] >= 0.28
    assert use["mars-short-ret"]["cpu_s"] >= use["mars-short-ret"]["children_cpu_s"]
    assert {p: v["cpu_s"] for p, v in rec["cells"][0]["policies"].items()} == {p: u["cpu_s"] for p, u in use.items()}
    # runs recorded before usage.json existed: no file, no field; --report still writes the table
    for p in exp.policies:
        (d / p / "usage.json").unlink()
    (d / "cell.json").unlink()
    old = run_experiment(exp, tmp_path / "o", progress=False, execute=False)
    assert all(v["cpu_s"] is None for v in old["cells"][0]["policies"].values()) and old["cpu_runs"] == 0
    table = (tmp_path / "o" / "table.md").read_text()
    assert "CPU time of the runs: not recorded" in table and "| 1.00 |" in table
    # an old results.json (no cpu fields anywhere) formats
    legacy = json.loads((tmp_path / "o" / "results.json").read_text())
    for k in ("cpu_s", "cpu_runs"):
        legacy.pop(k)
    for c in legacy["cells"]:
        for v in c["policies"].values():
            v.pop("cpu_s"), v.pop("cpu_imported_vllm")
    assert "CPU time of the runs: not recorded" in format_results(exp, legacy)
    shutil.rmtree(tmp_path / "o")


def test_cli_lists_cells_and_exits_2_on_a_bad_only(grid, capsys):
    from vllm_mars.cli import main

    exp, out, _ = grid
    assert main(["experiment", "run", str(exp.path), "--out", str(out), "--list"]) == 0
    printed = capsys.readouterr().out
    assert "done  compact/rps2/seed0" in printed and "2 cells, 6 runs" in printed
    assert main(["experiment", "run", str(exp.path), "--out", str(out), "--only", "ILR-9/*"]) == 2
    assert "matches no cell" in capsys.readouterr().err


@pytest.mark.parametrize("edit, field, text", [
    (("policies = [", "colour = 1\npolicies = ["), "colour", "unknown key"),
    (('"fcfs", "mars-short-ret"]', '"fcfs", "mars-short-ret", "fifo"]'), "policies[3]", "'fifo'"),
    (("rps = [2, 8]", "rps = [2, 0]"), "workloads[0].rps[1]", "rps must be >= 0.001, got 0"),
    (("rps = [2, 8]", "rps = []"), "workloads[0].rps", "non-empty list"),
    (("rps = [2, 8]", 'rps = "fast"'), "workloads[0].rps", "non-empty list"),
    (("rps = [2, 8]", "rps = [2, 2]"), "workloads[0].rps", "repeated"),
    (("max_retention_s = 0.5", "max_retention = 0.5"), "variants.mars-short-ret.policy_options",
     "unknown config key"),
    (('policy = "mars"\n', 'policy = "marz"\n'), "variants.mars-short-ret.policy", "not registered"),
    (("[variants.mars-short-ret]", "[variants.mars-short-ret.5]"), "variants.mars-short-ret.5",
     'quoted in the table header: [variants."mars-short-ret.5"]'),
    (("num_workflows = 3", "num_workflows = 0"), "num_workflows", ">= 1"),
    (('name = "compact"', 'name = "compact"\nshape = 3'), "workloads[0].shape", "unknown key"),
    (('path = "', 'preset = "ILR-1"\npath = "'), "workloads[0]", "exactly one of preset, path, weka"),
    (('path = "', 'path = "/nonexistent/x.jsonl"\n#'), "workloads[0].path", "not found"),
    (("[[workloads]]", "[replay]\nmax_num_seqs = 'many'\n[[workloads]]"), "replay.max_num_seqs",
     "expected int"),
    (("[[workloads]]", "[replay]\nrps = 3\n[[workloads]]"), "replay.rps", "unknown key"),
    (("[[workloads]]", "[replay]\nkv_scale = 0\n[[workloads]]"), "replay", "kv_scale must be > 0"),
    (("[[workloads]]", "[replay]\nkv_scale = 1e9\n[[workloads]]"), "replay",
     "the sim's KV pool must be 2..5000000 blocks (profile h200-qwen3-coder-30b-a3b: "),
    (("[[workloads]]", "[replay]\nkv_scale = 2\nnum_blocks = 9\n[[workloads]]"), "replay", "give one of them"),
    (('arrival = "fixed"', 'arrival = "bursty"'), "arrival", "allowed: fixed, poisson, trace"),
    (('backend = "sim"', 'backend = "gpu"'), "backend", "'gpu' unknown; allowed: inprocess, http, sim"),
    ((f'profile = "{PROFILE}"', 'profile = "a100-nope"'), "profile", "a100-nope"),
    (("policies = [", "seeds = [0, -1]\npolicies = ["), "seeds[1]", ">= 0"),
    (("rps = [2, 8]", 'rps = [2, 8]\npolicies = ["fcfs", "lightllm"]'), "workloads[0].policies",
     "'lightllm' is not in the top-level policies"),
])
def test_validation_errors_name_the_file_and_field(tmp_path, capsys, edit, field, text):
    from vllm_mars.cli import main
    from vllm_mars.experiment.spec import ExperimentError, load_experiment

    old, new = edit
    assert old in GRID, old
    path = write(tmp_path, GRID.replace(old, new, 1))
    with pytest.raises(ExperimentError) as e:
        load_experiment(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {field}: ") and text in msg and "\n" not in msg, msg
    assert main(["experiment", "run", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mars experiment: error: {msg}"
    assert not (tmp_path / "o").exists()


def test_shipped_experiment_files_are_valid_and_cover_every_policy():
    from vllm_mars.driver.control import driver_policy_names
    from vllm_mars.experiment.spec import load_experiment

    files = sorted((REPO / "experiments" / "studies").glob("*.toml"))
    assert {f.name for f in files} >= {"paper_grid.toml", "paper_grid_seeds.toml", "paper_grid_ablations.toml",
                                       "h100_qwen3_32b.toml", "weka_traces.toml"}
    raws = {f.stem: tomllib.loads(f.read_text()) for f in files}
    assert all(r.get("status") for r in raws.values()), "every study says its status"
    exps = {f.stem: load_experiment(f) for f in files if not raws[f.stem]["status"].startswith("retired")}
    paper = exps["paper_grid"]
    assert [w.name for w in paper.workloads] == ["ILR-1", "ILR-2", "ILR-3", "ILR-4"]
    assert all(len(w.rps) == 5 for w in paper.workloads) and paper.seeds == (0,)
    seeds, abl = exps["paper_grid_seeds"], exps["paper_grid_ablations"]
    # every registered policy is in the paper grid, its seeds or its ablation file, or named as cut (with why)
    cut = {"infercept_swap", "continuum_dy"}
    in_files = set(paper.policies) | set(seeds.policies) | set(abl.policies)
    in_files |= {p for w in abl.workloads for p in (w.policies or ())}
    # the paper's figure grids (experiments/paper/) carry every policy, the CONCUR pairings included
    # and the admission yardstick's capped runs (variants of fcfs-cap / mars-cap)
    for f in sorted((REPO / "experiments" / "paper").glob("*.toml")):
        e = load_experiment(f)
        in_files |= set(e.policies) | {v["policy"] for v in e.variants.values()}
    assert set(driver_policy_names()) <= in_files | cut
    text = (REPO / "experiments" / "studies" / "paper_grid.toml").read_text()
    assert all(f"{c} (" in text for c in cut)
    assert seeds.seeds == (1, 2) and "mars" in seeds.policies
    assert abl.seeds == (0,) and {v["policy"] for v in abl.variants.values()} == {"mars"}
    assert exps["weka_traces"].workloads[0].weka and exps["weka_traces"].workloads[0].scale in (None, 1.0)


def test_status_is_checked_and_a_retired_experiment_does_not_run(tmp_path, capsys):
    from vllm_mars.cli import main
    from vllm_mars.experiment.spec import ExperimentError, load_experiment

    assert load_experiment(write(tmp_path, 'status = "ablation"\n' + GRID)).name == "two-cells"
    bad = write(tmp_path, 'status = "old"\n' + GRID, "bad.toml")
    with pytest.raises(ExperimentError, match=r"bad.toml: status: 'old': expected canonical, ablation or 'retired COMMIT'"):
        load_experiment(bad)
    # a retired study refuses before its settings are read (they may name options that are gone)
    gone = write(tmp_path, 'status = "retired 9c2977a"\n' + GRID.replace("max_retention_s", "no_such_option"),
                 "gone.toml")
    with pytest.raises(ExperimentError, match="status: retired 9c2977a: this experiment no longer runs"):
        load_experiment(gone)
    assert main(["experiment", "run", str(gone), "--out", str(tmp_path / "o")]) == 2
    assert "git show 9c2977a:experiments/results/gone/table.md" in capsys.readouterr().err


def test_experiments_readme_table_is_generated_from_the_headers(tmp_path, capsys):
    from vllm_mars.cli import main
    from vllm_mars.experiment.readme import BEGIN, END, update_readme

    assert not update_readme(REPO / "experiments", check=True), "run `mars experiment readme`"
    # every experiment file (paper/, studies/, scale_out/, ...) states its status and has its row
    root = REPO / "experiments"
    files = sorted(p for p in root.rglob("*.toml") if "results" not in p.relative_to(root).parts)
    assert {f.parent.name for f in files} >= {"paper", "studies", "scale_out"}
    readme = (root / "README.md").read_text()
    for f in files:
        status = tomllib.loads(f.read_text()).get("status")
        assert status, f"{f}: no status line"
        assert f"| `{f.relative_to(root).as_posix()}` | {status} |" in readme, f
    (tmp_path / "studies").mkdir()
    (tmp_path / "results" / "two-cells").mkdir(parents=True)
    write(tmp_path / "studies", 'status = "canonical"\n' + GRID, "a.toml")
    (tmp_path / "README.md").write_text(f"# E\n\n{BEGIN}\nstale\n{END}\n\nprose\n")
    assert main(["experiment", "readme", str(tmp_path), "--check"]) == 1
    assert main(["experiment", "readme", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "| `studies/a.toml` | canonical | compact x 2 rps on the sim | `results/two-cells/` |" in text
    assert "stale" not in text and text.endswith("\n\nprose\n")
    assert main(["experiment", "readme", str(tmp_path), "--check"]) == 0
    capsys.readouterr()


@pytest.mark.slow
def test_parallel_cells_give_the_same_table_as_serial(grid, tmp_path):
    """--jobs 2: cells in spawned processes, one calibrating run first; same numbers as serial."""
    from vllm_mars.experiment.grid import run_experiment

    exp, _, serial = grid
    import resource

    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    par = run_experiment(exp, tmp_path / "par", jobs=2, progress=False)
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # each run's CPU is its worker's own (the calibrating run, in this process, aside): the workers'
    # runs add up to no more than the CPU the workers took in all
    worker = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    runs = {(c["key"], p): d["cpu_s"] for c in par["cells"] for p, d in c["policies"].items()}
    assert all(x > 0 for x in runs.values())
    assert sum(runs.values()) - runs[("compact/rps2/seed0", "mars")] <= worker  # that one calibrated, here
    assert [c["key"] for c in par["cells"]] == [c["key"] for c in serial["cells"]]
    for a, b in zip(par["cells"], serial["cells"]):
        assert a["speedup"] == pytest.approx(b["speedup"])
        assert {p: d["mean_e2e_s"] for p, d in a["policies"].items()} == pytest.approx(
            {p: d["mean_e2e_s"] for p, d in b["policies"].items()})


def test_a_preset_cut_by_max_context_replays_the_roots_left_not_cycled_back_to_the_count(tmp_path):
    """A generated preset draws ``num_workflows`` roots once; those over ``max_context`` are dropped and the
    cell replays the rest, each once (it used to cycle the file back up to the count: repeats ``~1``)."""
    from vllm_mars.experiment.grid import run_experiment
    from vllm_mars.experiment.spec import load_experiment

    exp = load_experiment(write(tmp_path, f"""
name = "cut"
description = "ILR-1 / 32, roots over 500 tokens dropped"
backend = "sim"
profile = "{PROFILE}"
arrival = "fixed"
num_workflows = 4
policies = ["fcfs"]

[[workloads]]
name = "S"
preset = "ILR-1"
scale = 32.0
max_context = 500
rps = [1]
"""))
    record = run_experiment(exp, tmp_path / "out", progress=False)
    (cell,) = record["cells"]
    assert 0 < cell["roots"] < 4 and cell["roots"] + cell["dropped_over_context"] == 4
    run = tmp_path / "out" / "runs" / "S" / "rps1" / "seed0" / "fcfs"
    s = json.loads((run / "summary.json").read_text())
    assert s["workflows"] == s["completed"] == cell["roots"] and s["errors"] == 0
    assert json.loads((run / "run_config.json").read_text())["num_workflows"] == cell["roots"]
    assert "~1" not in (run / "events.jsonl").read_text()  # no root replayed twice
    assert s["engine"]["leak_check"] == "ok" and s["engine"]["free_blocks"] == s["engine"]["num_blocks"]
