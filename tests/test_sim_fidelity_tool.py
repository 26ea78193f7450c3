"""benchmark/perf/sim_fidelity.py end to end on a small workload: the real CPU engine, a pass over the
grid after each repeat's real runs (also under --real-only, so the grid and the runs share the box's state),
then the sims on those runs with --no-new-real; and its one-line errors on a work dir that lacks them."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from test_sim_fidelity import _workload
from vllm_mars.sim.profile import load_profile

TOOL = Path(__file__).resolve().parents[1] / "benchmark" / "perf" / "sim_fidelity.py"


def _tool():
    spec = importlib.util.spec_from_file_location("sim_fidelity", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grid_fit_follows_the_real_runs_then_the_sims_use_it(tmp_path, tiny_model, capsys):
    sf = _tool()
    wl = str(_workload(tmp_path / "wl.jsonl", n=4))
    out = tmp_path / "fid"
    common = ["--policies", "fcfs", "--workloads", wl, "--repeats", "1", "--out", str(out)]
    assert sf.main([*common, "--real-only", "--grid", "tiny", "--grid-repeats", "1", "--results", ""]) == 0
    real = out / "wl" / "real-fcfs-r0"
    grid = out / "cpu-tiny-grid.toml"
    steps = out / "grid_steps-p0.jsonl"  # the pass over the grid after repeat 0
    assert (real / "steps.jsonl").exists() and grid.exists() and steps.exists()
    # timed after the real run, in this process: not a file from another time; the fit is of that pass
    assert steps.stat().st_mtime > (real / "summary.json").stat().st_mtime
    assert "fitted by `mars profile --from-steps` to 1 recorded" in load_profile(str(grid)).efficiency.source
    assert load_profile(str(grid)).efficiency.source.endswith(f"over {len(steps.read_text().splitlines())} steps")

    # the sims on those runs: the grid fit beside them is the grid profile, no new engine run
    res = tmp_path / "res.json"
    assert sf.main([*common, "--no-new-real", "--scales", "1", "--results", str(res)]) == 0
    doc = json.loads(res.read_text())
    assert doc["_meta"]["profile"] == str(grid) and doc["_meta"]["real_runs"] == {"wl": {"fcfs": 1}}
    r = doc["wl"]["fcfs"]
    assert r["real"]["runs"][0]["completed"] == 4
    assert r["trace"]["exact"] == 1  # the trace replay: this very run, batch for batch
    for key in ("own_run_fit", "grid_fit"):
        assert r[key]["mean_e2e_err"] is not None and abs(r[key]["mean_e2e_err"]) < 0.75, (key, r[key])
    # leak checks: the real engine ended with every KV block free and nothing retained; every sim run
    # closed with its own (the sim backend raises on a leak)
    for d in (out / "wl").iterdir():
        if d.is_dir():
            end = json.loads((d / "events.jsonl").read_text().splitlines()[-1])
            assert end["event"] == "run_end", d
            eng = end["engine"]
            assert eng["free_blocks"] == eng["num_blocks"] and eng["retained_blocks"] == 0, (d, eng)
            assert d.name.startswith("real") or eng["leak_check"] == "ok", (d, eng)

    # a work dir without the grid fit: --no-new-real will not fit one after the fact
    bare = tmp_path / "bare"
    shutil.copytree(out / "wl", bare / "wl")
    with pytest.raises(SystemExit) as e:
        sf.main([*common[:-1], str(bare), "--no-new-real", "--results", ""])
    assert e.value.code == 2 and "no grid fit" in capsys.readouterr().err
    # ... but fits one from the passes kept beside the runs (no engine run)
    shutil.copy(steps, bare / steps.name)
    assert sf.main([*common[:-1], str(bare), "--no-new-real", "--real-only", "--results", ""]) == 0
    coef = ("mfu", "attn_mfu", "bw_eff", "step_overhead_s", "per_seq_overhead_s")
    refit, first = load_profile(str(bare / grid.name)).efficiency, load_profile(str(grid)).efficiency
    assert [getattr(refit, k) for k in coef] == [getattr(first, k) for k in coef]
    # ... nor run without the real runs
    with pytest.raises(SystemExit) as e:
        sf.main([*common[:-1], str(tmp_path / "empty"), "--no-new-real", "--results", ""])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no finished real runs" in err and "wl fcfs" in err, err


def test_a_stretched_workload_by_name_and_its_errors(tmp_path, capsys):
    """compact:K is compact with its clock x K (cpu_default_rounds' stretch, under the name of the file that
    writes); --pool --runs takes a half of each file's repeats; --table names every policy behind the winner.
    No engine: bad values stop before any run."""
    sf = _tool()
    assert sf.workload_name("compact:0.2") == "compact_s0.2" and sf.workload_name("ilr3:2") == "ilr3_s2"
    assert sf.workload_name("compact") == "compact" and sf.workload_name("a/b:c.jsonl") == "b:c"
    path = Path(sf.workload_file("compact:0.2", tmp_path))
    assert path == tmp_path / "compact_s0.2.jsonl"
    src = [json.loads(x) for x in Path(sf.workload_file("compact", tmp_path)).read_text().splitlines() if x.strip()]
    got = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(got) == len(src) > 0
    for a, b in zip(src, got):
        assert [t.get("output_tokens") for t in a["turns"]] == [t.get("output_tokens") for t in b["turns"]]
        assert [t.get("tool_s") and round(t["tool_s"] * 0.2, 6) for t in a["turns"]] == \
            [t.get("tool_s") for t in b["turns"]]
        assert (a.get("arrival_s") is None) == (b.get("arrival_s") is None)
    assert any(t.get("tool_s") for wf in got for t in wf["turns"])

    for bad, msg in (("compact:x", "got 'x'"), ("compact:0.05", "[0.1, 100]"), ("ilr3:", "ilr3:K"),
                     (str(tmp_path / "none.jsonl"), "no file")):
        with pytest.raises(SystemExit) as e:
            sf.main(["--workloads", bad, "--out", str(tmp_path / "w"), "--results", ""])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and msg in err[-1], (bad, err)
    assert not (tmp_path / "w").exists()  # stopped before the work dir, let alone a run

    # --pool --runs: the per-run bias of repeats A to B-1 only
    doc = {"w": {"fcfs": {"own_run_fit": {"per_run": {"preemptions": {"pairs": [[4, 8], [4, 8], [8, 4], [8, 4]]}}}}}}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    halves = []
    for runs in ("0:2", "2:", ""):
        argv = ["--pool", str(tmp_path / "r.json")] + (["--runs", runs] if runs else [])
        assert sf.main(argv) == 0
        halves.append(json.loads(capsys.readouterr().out)["w"]["fcfs"]["preemptions"])
    assert [h["runs"] for h in halves] == [2, 2, 4]
    assert halves[0]["mean_log_ratio"] == 0.6931 and halves[1]["mean_log_ratio"] == -0.6931
    assert halves[2]["mean_log_ratio"] == 0.0
    with pytest.raises(SystemExit) as e:
        sf.main(["--pool", str(tmp_path / "r.json"), "--runs", "3"])
    assert e.value.code == 2 and "A:B expected" in capsys.readouterr().err

    # --table's winners on the stored s02 results: every other policy behind the real winner, repeat by repeat
    s02 = json.loads((TOOL.parent / "results" / "sim_fidelity_s02.json").read_text())
    runs = {p: [r["mean_e2e_s"] for r in s02["compact_s0.2"][p]["real"]["runs"]] for p in ("mars", "fcfs")}
    gap = sf.paired_gap(*[[{"mean_e2e_s": x} for x in runs[p]] for p in ("mars", "fcfs")])
    assert gap["runs"] == 10 and gap["mean_log_ratio"] > 2 * gap["stderr"] > 0  # fcfs behind mars, beyond noise
    text = sf.table(s02)
    assert f"fcfs {gap['mean_log_ratio'] * 100:+.1f} +- {gap['stderr'] * 100:.1f} %" in text and "continuum +" in text
