"""The task driver: arrivals, the real-tool sandbox, end-to-end replays on the CPU engine and over HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import time
from pathlib import Path

import pytest
from vllm_mars.driver.arrivals import arrival_times
from vllm_mars.driver.control import resolve_policy
from vllm_mars.driver.tools import RealTools, SimulatedTools, detect_sandbox, parse_cpu_list
from vllm_mars.metrics.events import read_events, read_jsonl
from vllm_mars.metrics.summary import summarize

REPO = Path(__file__).resolve().parents[1]


# -- arrivals ---------------------------------------------------------------------------------------
def test_fixed_arrivals_are_i_over_rps():
    assert arrival_times(4, process="fixed", rps=2.0) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(0, process="fixed", rps=2.0) == []


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = arrival_times(2000, process="poisson", rps=4.0, seed=7)
    assert a == arrival_times(2000, process="poisson", rps=4.0, seed=7)
    assert a != arrival_times(2000, process="poisson", rps=4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.08)
    # exponential gaps: about 1/e of them exceed the mean
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.04)


def test_trace_arrivals_shift_to_zero_and_errors_are_clear():
    assert arrival_times(3, process="trace", trace=[5.0, 7.5, 6.0]) == [0.0, 2.5, 1.0]
    with pytest.raises(ValueError, match=r"index \[1\] have no arrival_s"):
        arrival_times(2, process="trace", trace=[1.0, None])
    with pytest.raises(ValueError, match="needs rps > 0"):
        arrival_times(2, process="poisson", rps=0)
    with pytest.raises(ValueError, match="allowed: fixed, poisson, trace"):
        arrival_times(2, process="burst", rps=1)


def test_policy_names_map_to_scheduler_and_controller():
    assert (resolve_policy("mars").scheduler_policy, resolve_policy("mars").controller) == ("mars", "mars")
    assert (resolve_policy("concur").scheduler_policy, resolve_policy("concur").controller) == ("fcfs", "concur")
    assert (resolve_policy("mars-no-admission").scheduler_policy,
            resolve_policy("mars-no-admission").controller) == ("mars", "none")
    assert (resolve_policy("autellix").scheduler_policy, resolve_policy("autellix").controller) == ("autellix", "none")


def test_cpu_lists():
    assert parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert parse_cpu_list("") == [] and parse_cpu_list(None) == []
    with pytest.raises(ValueError, match="bad element 'x'"):
        parse_cpu_list("0,x")
    with pytest.raises(ValueError, match="descending"):
        parse_cpu_list("3-1")


# -- tools ------------------------------------------------------------------------------------------
def _sandboxes() -> list[str]:
    from vllm_mars.driver._sandbox_exec import landlock_abi

    out = []
    if detect_sandbox() == "bwrap":
        out.append("bwrap")
    if landlock_abi() >= 1:
        out.append("landlock")
    return out or ["unavailable"]


@pytest.mark.parametrize("sandbox", _sandboxes())
def test_real_tool_cannot_write_outside_its_workspace(tmp_path, sandbox):
    if sandbox == "unavailable":
        pytest.skip("neither bubblewrap nor Landlock works on this host")
    outside = tmp_path / "outside.txt"
    home_file = Path.home() / f".mars-sandbox-probe-{os.getpid()}"
    core = max(os.sched_getaffinity(0))

    async def main():
        tools = RealTools(time.monotonic, tmp_path / "ws", [core], timeout_s=1.5, sandbox=sandbox)
        cmd = (f"echo inside > result.txt; echo x > {outside} ; echo y > {home_file} ; "
               "grep Cpus_allowed_list /proc/self/status")
        r = await tools.run("wf/a", 0, "bash", cmd, 0.0)
        t = await tools.run("wf/a", 1, "bash", "sleep 30 & sleep 30", 0.0)
        return tools, r, t

    tools, r, slow = asyncio.run(main())
    ws = tools.workspace("wf/a")
    assert ws.parent == (tmp_path / "ws").resolve()
    assert (ws / "result.txt").read_text() == "inside\n"
    assert not outside.exists() and not home_file.exists()
    assert f"Cpus_allowed_list:\t{core}" in r.stdout_tail
    assert r.sandbox == sandbox and r.core == core
    # the timeout kills the whole process group, background children included
    assert slow.timed_out and slow.rc == 124 and slow.duration_s < 6


def test_simulated_tools_sleep_the_recorded_time_and_count_in_flight():
    async def main():
        tools = SimulatedTools(time.monotonic, workers=4)
        task = asyncio.create_task(tools.run("w", 0, "bash", None, 0.2))
        await asyncio.sleep(0.05)
        mid = tools.stats().in_flight
        r = await task
        return mid, r, tools.stats()

    mid, r, after = asyncio.run(main())
    assert mid == 1 and after.in_flight == 0 and after.workers == 4
    assert 0.19 <= r.duration_s < 0.6


# -- end to end on the CPU engine -------------------------------------------------------------------
def write_workload(path: Path, n: int = 6, seed: int = 3) -> Path:
    """``n`` small workflows sharing a 64-token system prefix, 3 turns each, one with a child."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        turns = [{"output_tokens": rng.randint(20, 40), "tool_s": round(rng.uniform(0.05, 0.2), 3), "tool": "bash"},
                 {"append_tokens": rng.randint(16, 48), "output_tokens": rng.randint(20, 40),
                  "tool_s": round(rng.uniform(0.05, 0.2), 3), "tool": "read"},
                 {"append_tokens": rng.randint(16, 48), "output_tokens": rng.randint(20, 40)}]
        wf = {"schema": "mars_workload_v1", "workflow_id": f"t{i}", "prefix": [{"tokens": 64, "key": "sys"}],
              "prompt_tokens": rng.randint(120, 200), "turns": turns}
        if i == 1:
            wf["children"] = [{"after_turn": 0, "workflow": {
                "workflow_id": "t1.c0", "prompt_tokens": 80,
                "turns": [{"output_tokens": 10, "tool_s": 0.05, "tool": "bash"},
                          {"append_tokens": 20, "output_tokens": 10}]}}]
        lines.append(json.dumps(wf))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def compared(tmp_path_factory, tiny_model):
    from vllm_mars.driver.compare import run_compare
    from vllm_mars.driver.runner import ReplayConfig

    d = tmp_path_factory.mktemp("compare")
    wl = write_workload(d / "wl.jsonl")
    base = ReplayConfig(workload=str(wl), model=tiny_model, num_blocks=16, max_num_batched_tokens=512,
                        max_num_seqs=16, progress=False, sample_interval_s=0.05)
    said: list[str] = []  # what the scheduler warned (module-scoped: no caplog)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: said.append(r.getMessage())
    sched_log = logging.getLogger("vllm_mars.engine.scheduler")
    sched_log.addHandler(handler)
    try:
        out, record = run_compare(base, ["mars", "fcfs"], [8.0], d / "out")
    finally:
        sched_log.removeHandler(handler)
    return wl, out, record, said


def _check_run(run_dir: Path, wl: Path) -> dict:
    from vllm_mars.workload.materialize import load_plans

    for name in ("run_config.json", "events.jsonl", "traces.jsonl", "summary.json", "report.md",
                 "e2e_cdf.png", "ttft_by_round.png", "kv_usage.png", "admission.png"):
        assert (run_dir / name).is_file(), name
    events = read_events(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(summarize(events)))
    # recompute the headline fields by hand from the raw events
    arrive = {e["workflow"]: e["ts"] for e in events if e["event"] == "workflow_arrive"}
    done = {e["workflow"]: e["ts"] for e in events if e["event"] == "workflow_done" and e["root_done"]}
    assert set(arrive) == set(done) == {f"t{i}" for i in range(6)}
    e2e = [done[w] - arrive[w] for w in done]
    assert summary["completed"] == 6 and summary["errors"] == 0 and summary["completion_rate"] == 1.0
    assert summary["e2e_s"]["mean"] == pytest.approx(sum(e2e) / len(e2e))
    assert summary["e2e_s"]["p99"] == pytest.approx(sorted(e2e)[-2] + 0.95 * (max(e2e) - sorted(e2e)[-2]))
    ideal = {e["workflow"]: e["t_ideal_s"] for e in events if e["event"] == "workflow_arrive"}
    assert all(v > 0 for v in ideal.values())
    assert summary["goodput_within"]["3.0"] == sum(done[w] - arrive[w] <= 3 * ideal[w] for w in done)
    calls = [e for e in events if e["event"] == "call_end"]
    assert len(calls) == 6 * 3 + 2
    assert summary["prefix_hit_rate"] == pytest.approx(sum(c["cached_tokens"] for c in calls)
                                                       / sum(c["prompt_tokens"] for c in calls))
    samples = [e for e in events if e["event"] == "kv_sample"]
    assert summary["preemptions"] == samples[-1]["preemptions"] - samples[0]["preemptions"]
    # Engine readings are dated on the run clock: none after the instant it was taken at, and the
    # controller never works on a reading from its future (the calibration's last one was once
    # kept that way for seconds, every real reading rejected as older).
    assert all(e["engine_ts"] <= e["ts"] + 1e-6 for e in samples)
    ages = [e["telemetry_age_s"] for e in events if e["event"] == "admission_admit" and "telemetry_age_s" in e]
    assert all(a is None or a >= 0 for a in ages)
    # ... and it sees every field the engine reports, its queue included (the driver once passed
    # on only some of them: no controller saw a call waiting in the engine)
    seen = [e for e in events if e["event"] == "admission_admit" and e.get("telemetry_age_s") is not None]
    assert all(e["engine_waiting"] is not None and e["engine_running"] is not None for e in seen)
    # prompts grow turn by turn: turn k = turn k-1 + its output + the appended tool output
    plans = {p.workflow_id: p for root in load_plans(wl) for p in root.walk()}
    traces = {t["workflow"]: t for t in read_jsonl(run_dir / "traces.jsonl")}
    assert set(traces) == set(plans)
    for wid, tr in traces.items():
        plan, rounds = plans[wid], tr["rounds"]
        assert [r["output_tokens"] for r in rounds] == [t.output_tokens for t in plan.turns]
        assert rounds[0]["prompt_tokens"] == len(plan.initial_ids)
        for k in range(1, len(rounds)):
            assert rounds[k]["prompt_tokens"] == (rounds[k - 1]["prompt_tokens"] + rounds[k - 1]["output_tokens"]
                                                  + len(plan.turns[k].appended_ids))
    # the child carries its parent's identity and started after the parent's first call
    assert traces["t1.c0"]["parent"] == "t1" and traces["t1.c0"]["root"] == "t1"
    assert traces["t1.c0"]["start_ts"] >= traces["t1"]["rounds"][0]["end_ts"]
    # no leaks: every KV block free, no retention left, nothing running
    end = [e for e in events if e["event"] == "run_end"][-1]["engine"]
    assert end["free_blocks"] == end["num_blocks"] and end["retained_blocks"] == 0
    return summary


def test_replay_two_policies_end_to_end_on_the_cpu_engine(compared):
    wl, out, record, said = compared
    cell = record["cells"][0]
    assert set(cell["policies"]) == {"mars", "fcfs"} and cell["baseline"] == "fcfs"
    assert cell["speedup"] == pytest.approx(cell["baseline_mean_e2e_s"] / cell["mars_mean_e2e_s"])
    fcfs = _check_run(Path(cell["policies"]["fcfs"]["run_dir"]), wl)
    mars = _check_run(Path(cell["policies"]["mars"]["run_dir"]), wl)
    assert fcfs["preemptions"] > 0, "16 blocks must force fcfs to preempt"
    assert fcfs["recomputed_tokens"] > 0
    # KV block removals (vLLM KV cache events): the summary's count is the kv_sample counter's span.
    fcfs_samples = [e["kv_blocks_removed"] for e in read_events(cell["policies"]["fcfs"]["run_dir"])
                    if e["event"] == "kv_sample"]
    assert fcfs["kv_blocks_removed"] == fcfs_samples[-1] - fcfs_samples[0] > 0
    assert (out / "kv_removals_rps8.png").is_file()
    assert mars["controller"] == "mars" and mars["admission"]["admitted"] == 6
    fcfs_events = read_events(cell["policies"]["fcfs"]["run_dir"])
    assert {e["controller"] for e in fcfs_events if e["event"] == "admission_admit"} == {"none"}
    assert (out / "compare.json").is_file() and (out / "report.md").is_file() and (out / "e2e_cdf_rps8.png").is_file()
    # mars (the first run) calibrated on its own engine and then pinned that model: its calls were
    # not the run, so no "UNCALIBRATED" warning (each `mars compare` once printed a false one)
    assert not [m for m in said if "UNCALIBRATED" in m], said


def test_mars_report_recomputes_a_compare_dir(compared, capsys):
    from vllm_mars.cli import main

    _, out, _, _ = compared
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "vs fcfs" in printed and "| 8.00 | mars |" in printed


def test_compare_defaults_point_at_the_bundled_workload():
    from vllm_mars.cli import build_parser
    from vllm_mars.commands.driver import compare_config
    from vllm_mars.engine.local import COMPARE_CPU_NUM_BLOCKS, on_cpu

    args = build_parser().parse_args(["compare"])
    cfg, policies = compare_config(args)
    assert Path(cfg.workload) == REPO / "benchmark" / "workloads" / "compact.jsonl"
    assert Path(cfg.workload).is_file()
    assert {"mars", "fcfs"} <= set(policies)
    assert COMPARE_CPU_NUM_BLOCKS <= 64  # small on CPU; vLLM's sizing on GPU
    assert cfg.num_blocks == (COMPARE_CPU_NUM_BLOCKS if on_cpu() else None)


def test_cli_flags_are_the_config_fields_and_their_defaults(monkeypatch):
    """One flag per ReplayConfig field, its default the dataclass's: a command line without flags is
    ReplayConfig(); every flag lands in its field; an environment variable overrides a default."""
    import dataclasses

    from vllm_mars.cli import build_parser
    from vllm_mars.commands.driver import config_from_args
    from vllm_mars.driver.config import ReplayConfig

    for var in ("RPS", "SCHEDULING_POLICY", "CPU_TOOL", "CPU_GPU"):
        monkeypatch.delenv(var, raising=False)
    cfg = config_from_args(build_parser().parse_args(["replay"]))
    assert dataclasses.replace(cfg, progress=True) == ReplayConfig()
    given = config_from_args(build_parser().parse_args([
        "replay", "--tool-timeout", "5", "--call-timeout", "9", "--sample-interval", "2", "--no-plots",
        "--no-calibrate", "--record-steps", "--engine-arg", "max_num_seqs=4", "--policy-option", "retention=false",
        "--admission-option", "window_max=3", "--tool-net-allow", "80", "--tool-net-allow", "81",
        "--num-workflows", "2", "--max-model-len", "1000", "--arrival", "poisson"]))
    assert (given.tool_timeout_s, given.call_timeout_s, given.sample_interval_s) == (5.0, 9.0, 2.0)
    assert not given.plots and not given.calibrate and given.record_steps
    assert given.engine_args == {"max_num_seqs": 4} and given.policy_options == {"retention": False}
    assert given.admission_options == {"window_max": 3} and given.tool_net_allow == [80, 81]
    assert (given.num_workflows, given.max_model_len, given.arrival) == (2, 1000, "poisson")
    monkeypatch.setenv("RPS", "2.5")
    monkeypatch.setenv("SCHEDULING_POLICY", "mars")
    env = config_from_args(build_parser().parse_args(["replay"]))
    assert (env.rps, env.policy) == (2.5, "mars")
    import argparse

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("replay", "compare"):
        dests = {a.dest for a in sub.choices[command]._actions}
        own = {"policy", "rps", "url"} if command == "compare" else set()
        assert {f.name for f in dataclasses.fields(ReplayConfig)} - own <= dests, command


# -- HTTP backend against the real server ------------------------------------------------------------
def test_http_backend_replays_against_the_real_server(openai_server, tmp_path):
    from vllm_mars.driver.runner import ReplayConfig, run_replay

    wl = write_workload(tmp_path / "wl.jsonl", n=3, seed=5)
    cfg = ReplayConfig(workload=str(wl), policy="fcfs", rps=20.0, backend="http", url=openai_server.url,
                       progress=False, calibrate=False, out=str(tmp_path / "run"))
    out, _ = run_replay(cfg)
    events = read_events(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 3 and summary["errors"] == 0 and summary["backend"] == "http"
    calls = [e for e in events if e["event"] == "call_end"]
    assert len(calls) == 3 * 3 + 2 and all(c["output_tokens"] > 0 and c["ttft_s"] is not None for c in calls)
    samples = [e for e in events if e["event"] == "kv_sample"]
    # one Telemetry, read by the sidecar's parser: 256 blocks less vLLM's null block, as the sidecar counts
    assert any(s.get("total_blocks") == 255 for s in samples), "telemetry from /metrics cache_config_info"
    # the workflow metadata reached MarsScheduler through vllm_xargs
    log = openai_server.sched_log.read_text()
    assert '"mars_workflow": "t0"' in log or '"mars_workflow":"t0"' in log
    assert "t2:t2" in log


def test_num_workflows_cycles_the_file_with_unique_ids_and_context_is_checked(tmp_path):
    from vllm_mars.driver.runner import check_context, select_plans
    from vllm_mars.workload.materialize import load_plans

    path = write_workload(tmp_path / "wl.jsonl", n=3)
    plans = load_plans(path)
    assert [p.workflow_id for p in select_plans(plans, 2)] == ["t0", "t1"]
    assert [p.initial_ids for p in load_plans(path, num_workflows=2)] == [p.initial_ids for p in plans[:2]]
    more = load_plans(path, num_workflows=7)
    ids = [p.workflow_id for p in more]
    assert ids == ["t0", "t1", "t2", "t0~1", "t1~1", "t2~1", "t0~2"]
    child = more[4].children[0][1]
    assert (child.workflow_id, child.root_id, child.parent_id) == ("t1.c0~1", "t1~1", "t1~1")
    # a repeat is another session of the same shape: the keyed system prefix (64 tokens) is shared,
    # its task and turn tokens are its own (the originals' would share its whole context in the cache)
    assert more[:3] == plans
    for rep in (more[3], more[6]):
        assert rep.initial_ids[:64] == plans[0].initial_ids[:64]
        assert rep.initial_ids[64:] != plans[0].initial_ids[64:] and len(rep.initial_ids) == len(plans[0].initial_ids)
        assert [len(t.appended_ids) for t in rep.turns] == [len(t.appended_ids) for t in plans[0].turns]
        assert rep.turns[1].appended_ids != plans[0].turns[1].appended_ids
    assert more[3].initial_ids[64:] != more[6].initial_ids[64:]
    # plans built already (live tasks) are renamed as they are
    again = select_plans(plans, 4)
    assert again[3].workflow_id == "t0~1" and again[3].initial_ids == plans[0].initial_ids
    check_context(more, 2048)
    with pytest.raises(ValueError, match=r"workflow 't\d' reaches \d+ tokens of context, above max_model_len=100"):
        check_context(plans, 100)


def test_mas_task_v1_runs_as_live_agents_and_reports_parse_failures(tmp_path, tiny_model):
    """The preview's live-agent tasks: with the tiny random model nothing parses, and that is
    reported (events + summary), not a crash; workspace files are materialised; no KV leaks."""
    from vllm_mars.driver.runner import ReplayConfig, run_replay

    wl = tmp_path / "tasks.jsonl"
    wl.write_text("\n".join(json.dumps(t) for t in [
        {"schema": "mas_task_v1", "request_id": "tb:broken", "benchmark": "terminalbench",
         "payload": {"instruction": "Fix pip."}, "workspace_init": [{"path": "notes/a.txt", "content": "hi"}]},
        {"schema": "mas_task_v1", "request_id": "gen:1", "payload": {"text": "Write hello.py."}},
    ]) + "\n")
    cfg = ReplayConfig(workload=str(wl), policy="mars", model=tiny_model, num_blocks=64, progress=False,
                       out=str(tmp_path / "run"), calibrate=False)
    out, _ = run_replay(cfg)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 2 and summary["errors"] == 0
    agent = summary["agent"]
    assert agent["tasks"] == 2 and agent["rounds"] >= 2 and agent["parse_failures"] >= 1
    events = read_events(out)
    fails = [e for e in events if e["event"] == "agent_parse_failure"]
    assert len(fails) == agent["parse_failures"] and all(e["reason"] for e in fails)
    ends = [e for e in events if e["event"] == "call_end"]
    assert len(ends) == agent["rounds"]
    # turn k+1's prompt extends turn k's context (append-only text context)
    by_wf: dict[str, list] = {}
    for e in ends:
        by_wf.setdefault(e["workflow"], []).append(e)
    for calls in by_wf.values():
        assert all(b["prompt_tokens"] > a["prompt_tokens"] + a["output_tokens"] for a, b in itertools.pairwise(calls))
    assert (out / "workspaces" / "tb:broken" / "notes" / "a.txt").read_text() == "hi"
    end = [e for e in events if e["event"] == "run_end"][-1]["engine"]
    assert end["free_blocks"] == end["num_blocks"] and end["retained_blocks"] == 0


@pytest.mark.parametrize("sandbox", _sandboxes())
def test_real_tool_cannot_read_outside_or_connect_unless_allowed(tmp_path, sandbox):
    """Issue 11 defect 12: reads are confined to the workspace plus read-only system dirs, TCP connects
    are denied (the sidecar and vLLM listen on 127.0.0.1) except to an opt-in allow-listed port."""
    import contextlib
    import socket
    import threading

    if sandbox == "unavailable":
        pytest.skip("neither bubblewrap nor Landlock works on this host")
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret\n")
    checkout = Path(__file__).resolve().parents[1]
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end of the test
            while True:
                srv.accept()[0].close()

    threading.Thread(target=accept, daemon=True).start()
    core = max(os.sched_getaffinity(0))
    probe = (f"cat {secret}; echo rc_secret=$?; cat {checkout}/pyproject.toml >/dev/null; echo rc_checkout=$?; "
             f"cat /etc/hostname >/dev/null; echo rc_system=$?; echo mine > own.txt; cat own.txt; "
             f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; echo rc_connect=$?")

    async def main(**kw):
        tools = RealTools(time.monotonic, tmp_path / "ws", [core], timeout_s=10, sandbox=sandbox, **kw)
        return tools, await tools.run("wf", 0, "bash", probe, 0.0)

    tools, r = asyncio.run(main())
    out = r.stdout_tail
    assert "top secret" not in out and "rc_secret=1" in out, out
    assert "rc_checkout=0" not in out and "rc_system=0" in out and "mine" in out, out
    assert "rc_connect=1" in out, out
    assert "MARS_SANDBOX" not in r.stderr_tail
    assert tools.protections["mode"] == sandbox and tools.protections["tcp"].startswith("denied")
    assert not any(checkout.is_relative_to(p) for p in tools.protections["reads"])  # not the checkout
    if sandbox == "landlock":  # the opt-in allow-list (ports are Landlock-only)
        tools, r = asyncio.run(main(net_allow=[port]))
        assert "rc_connect=0" in r.stdout_tail and str(port) in tools.protections["tcp"], r.stdout_tail
    else:
        with pytest.raises(ValueError, match="cannot allow single ports"):
            asyncio.run(main(net_allow=[port]))
    srv.close()
