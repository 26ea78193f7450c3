"""The paired-rounds script of the embedded default (benchmark/perf/cpu_default_rounds.py): its
speed-adjusted estimate and its checks of --concurrent, without running an engine; and the online
cost fit over the steps of a virtual-time run (benchmark/perf/online_knee.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmark" / "perf" / "cpu_default_rounds.py"


@pytest.fixture(scope="module")
def rounds_script():
    spec = importlib.util.spec_from_file_location("cpu_default_rounds", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_speed_adjusted_speedup_is_the_intercept_at_equal_step_speed(rounds_script):
    # log speedup = 0.05 + 1.2 * log(speed ratio) exactly: the speedup at equal speed is e^0.05,
    # however unevenly the pairs' engines ran.
    ratios = [0.8, 0.9, 1.0, 1.1, 1.25]
    pairs = [(math.exp(0.05 + 1.2 * math.log(v)), v) for v in ratios]
    adj = rounds_script.speed_adjusted(pairs)
    assert adj["speedup"] == pytest.approx(math.exp(0.05), abs=1e-4)
    assert adj["slope"] == pytest.approx(1.2, abs=1e-3)
    assert adj["ci90"][0] == pytest.approx(adj["speedup"], abs=1e-3) == pytest.approx(adj["ci90"][1], abs=1e-3)
    assert adj["rounds"] == 5
    # With noise the interval widens around the intercept, not around the raw mean.
    noisy = [(r * (1.03 if i % 2 else 0.97), v) for i, (r, v) in enumerate(pairs)]
    wide = rounds_script.speed_adjusted(noisy)
    assert wide["ci90"][0] < math.exp(0.05) < wide["ci90"][1]
    # Too few rounds, or no spread in the speed ratios: no estimate.
    assert rounds_script.speed_adjusted(pairs[:2]) is None
    assert rounds_script.speed_adjusted([(1.1, 1.0)] * 4) is None


def test_concurrent_needs_a_core_per_variant(rounds_script, monkeypatch, capsys):
    monkeypatch.setattr(rounds_script.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit) as e:
        rounds_script.main(["--variants", "fcfs,mars", "--concurrent", "--rounds", "1", "--out", "/dev/null"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--concurrent: 2 variants (fcfs, mars) but 1 usable cores" in err and "one variant per core" in err


def test_stretch_slows_the_workloads_clock_and_keeps_its_tokens(rounds_script, tmp_path):
    src = tmp_path / "wl.jsonl"
    child = {"workflow_id": "r0.c", "prompt_tokens": 10, "turns": [{"output_tokens": 2, "tool_s": 0.5, "tool": "t"},
                                                                  {"append_tokens": 3, "output_tokens": 2}]}
    src.write_text(
        '{"schema":"mars_workload_v1","workflow_id":"r0","arrival_s":1.5,"prompt_tokens":40,'
        '"turns":[{"output_tokens":4,"tool_s":2.0,"tool":"bash"},{"append_tokens":5,"output_tokens":4}],'
        f'"children":[{{"after_turn":0,"workflow":{json.dumps(child)}}}]}}\n')
    from vllm_mars.workload.schema import load_workload

    (root,) = load_workload(rounds_script.stretch_workload(str(src), tmp_path / "out.jsonl", 4.0))
    assert root.arrival_s == 6.0 and [t.tool_s for t in root.turns] == [8.0, 0.0]
    kid = root.children[0].workflow
    assert [t.tool_s for t in kid.turns] == [2.0, 0.0]
    assert [t.output_tokens for t in root.turns] == [4, 4] and root.turns[1].append_tokens == 5
    assert kid.initial_tokens == 10 and kid.turns[1].append_tokens == 3


def test_stretch_out_of_range_is_a_usage_error(rounds_script, capsys):
    with pytest.raises(SystemExit) as e:
        rounds_script.main(["--stretch", "0", "--rounds", "1", "--out", "/dev/null"])
    assert e.value.code == 2 and "--stretch: must be in [0.1, 100], got 0" in capsys.readouterr().err


def test_keep_steps_needs_concurrent(rounds_script, capsys):
    with pytest.raises(SystemExit) as e:
        rounds_script.main(["--keep-steps", "/tmp/x", "--rounds", "1", "--out", "/dev/null"])
    assert e.value.code == 2 and "--keep-steps: only with --concurrent" in capsys.readouterr().err


@pytest.fixture(scope="module")
def speed_script():
    path = SCRIPT.parent / "cpu_default_speed_sim.py"
    spec = importlib.util.spec_from_file_location("cpu_default_speed_sim", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cpu_default_speed_sim"] = mod  # its worker function is pickled by module name
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("cpu_default_speed_sim", None)


def test_speed_rig_stretch_slows_the_workload_like_the_real_rounds(speed_script, tmp_path, capsys):
    # The rig's --stretch replays the stretched workload at rps / K: fcfs's mean E2E grows with the
    # tool times (the engine's steps are unchanged), and the record says what ran.
    out = {}
    for k in (1.0, 4.0):
        dest = tmp_path / f"s{k:g}.json"
        assert speed_script.main(["--scales", "1", "--seeds", "1", "--variants", "fcfs", "--jobs", "1",
                                  "--stretch", str(k), "--out", str(dest)]) == 0
        out[k] = json.loads(dest.read_text())
    assert out[4.0]["rps"] == pytest.approx(1.0) and out[4.0]["stretch"] == 4.0 and out[1.0]["rps"] == 4.0
    e2e = {k: r["runs"]["1"]["fcfs"]["0"]["mean_e2e_s"] for k, r in out.items()}
    assert e2e[4.0] > 2 * e2e[1.0], e2e
    # mars's record carries the policy's reading at the end (the priced reserve's, the evicted order's)
    dest = tmp_path / "mars.json"
    assert speed_script.main(["--scales", "1", "--seeds", "1", "--variants", "fcfs,mars", "--jobs", "1",
                              "--stretch", "4", "--out", str(dest)]) == 0
    runs = json.loads(dest.read_text())["runs"]["1"]
    assert "policy_state" not in runs["fcfs"]["0"]
    state = runs["mars"]["0"]["policy_state"]
    assert {"kept_share_ema", "reserve_priced_starts", "reserve_hold_median_s"} <= set(state), state
    with pytest.raises(SystemExit) as e:
        speed_script.main(["--stretch", "200", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "--stretch: must be in [0.1, 100], got 200" in capsys.readouterr().err


def test_rounds_record_keeps_preemptions_and_the_policys_state(rounds_script, tmp_path):
    # A run's record (the summary.json the driver writes) keeps its preemptions and, for a policy
    # that has one, its adaptive state at the end; a policy without one adds nothing.
    summary = {"e2e_s": {"mean": 20.0}, "goodput_wps": {"3.0": 0.5}, "makespan_s": 60.0, "preemptions": 7,
               "admission": {"wait_s": {"mean": 0.02}},
               "engine": {"policy_state": {"evicted": True, "reserve_priced_starts": 12}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    row = rounds_script.run_record(tmp_path)
    assert row["preemptions"] == 7 and row["mean_admission_wait_s"] == 0.02
    assert row["policy_state"] == {"evicted": True, "reserve_priced_starts": 12}
    summary["engine"]["policy_state"] = {}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert "policy_state" not in rounds_script.run_record(tmp_path)


def test_online_fit_over_a_virtual_time_run_never_loses_its_prefill_price():
    """The steps of a real (virtual-time) mars run on the H200 MoE profile, fed to OnlineCostFit as
    the scheduler feeds it: before its guard 160 of the ~1500 refits of this run clipped the linear
    prefill cost to zero (a short chunk priced at nothing, the prefill knee at billions of tokens)."""
    spec = importlib.util.spec_from_file_location("online_knee", SCRIPT.parent / "online_knee.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rec = mod.run_case("h200-qwen3-coder-30b-a3b", "ILR-3", 8, 0.08, None, seed=0)
    assert rec["refits"] > 1000 and rec["steps"] > 20000, rec
    assert rec["refits_knee_over_budget"] == 0, rec
    assert 0.5 < rec["rebuild_16k_over_profile_min"] and rec["rebuild_16k_over_profile_median"] < 2.0, rec
    assert rec["online_knee_p90"] < rec["profile_knee"], rec  # the linear fit's knee misses the MoE's


def test_cost_model_option_refuses_a_bad_file_in_one_line(rounds_script, tmp_path, capsys):
    bad = tmp_path / "cost.json"
    bad.write_text('{"prefill_s_per_token": -1}')
    with pytest.raises(SystemExit) as e:
        rounds_script.main(["--variants", "fcfs,mars", "--rounds", "1", "--cost-model", str(bad), "--out", "/dev/null"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--cost-model {bad}" in err and "prefill_s_per_token" in err


def test_online_knee_fits_recorded_steps_and_names_a_bad_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("online_knee", SCRIPT.parent / "online_knee.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    steps = tmp_path / "steps.jsonl"
    lines = []
    for i in range(200):  # 5 ms a step, 20 us a prefill token, nothing per decode
        n = 64 * (i % 9) if i % 3 else 0
        prefill = [[n, 32 * (i % 5)]] if n else []
        lines.append(json.dumps({"prefill": prefill, "decode": [100] * (1 + i % 4), "seconds": 0.005 + 2e-5 * n}))
    steps.write_text("\n".join(lines) + "\n")
    rec = mod.fit_steps(str(steps))
    assert rec["steps"] == 200 and rec["prefill_s_per_token"] == pytest.approx(2e-5, rel=0.01)
    assert rec["rebuild_1000_ms"] == pytest.approx(20.0, rel=0.02) and rec["knee"] == pytest.approx(250, abs=2)
    steps.write_text(lines[0] + "\n" + '{"prefill": [[1, 2]], "seconds": 0.1}\n')
    with pytest.raises(SystemExit, match=r"steps.jsonl:2: missing field 'decode'"):
        mod.fit_steps(str(steps))
