"""The simulated tool plane's CPU-tool limit (``CPU_TOOL``): calls hold one core for their recorded
time and queue for one beyond the cores, in arrival order; a cancelled call gives its core (or its
place) back; a sim run on a tool-bound cell shows the waits and hands the CPU signal to admission."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.driver.tools import SimulatedTools
from vllm_mars.metrics.compare import compare_record
from vllm_mars.metrics.events import read_events
from vllm_mars.sim.loop import run_virtual


def test_calls_beyond_the_cores_queue_in_arrival_order_in_virtual_time():
    async def main():
        loop = asyncio.get_running_loop()
        tools = SimulatedTools(loop.time, workers=2)
        tasks = [asyncio.create_task(tools.run(f"w{i}", 0, "bash", None, 1.0 + 0.5 * (i == 0))) for i in range(5)]
        await asyncio.sleep(0)
        mid = tools.stats()
        results = await asyncio.gather(*tasks)
        return mid, results, tools.stats()

    mid, rs, after = run_virtual(main())
    assert mid.in_flight == 5 and mid.workers == 2
    # w0 holds a core for 1.5 s, w1 for 1 s: w2 gets w1's core at 1.0, w3 w0's at 1.5, w4 w2's at 2.0
    assert [(r.start_ts, r.end_ts) for r in rs] == [(0.0, 1.5), (0.0, 1.0), (1.0, 2.0), (1.5, 2.5), (2.0, 3.0)]
    assert [r.wait_s for r in rs] == [0.0, 0.0, 1.0, 1.5, 2.0]
    assert after.in_flight == 0 and after.ema_queue_wait_s > 0


def test_without_cores_calls_never_queue():
    async def main():
        loop = asyncio.get_running_loop()
        tools = SimulatedTools(loop.time)
        return await asyncio.gather(*(tools.run("w", 0, None, None, 1.0) for _ in range(50)))

    assert all(r.start_ts == 0.0 and r.end_ts == 1.0 for r in run_virtual(main()))


def test_a_cancelled_call_gives_back_its_core_and_its_place():
    async def main():
        loop = asyncio.get_running_loop()
        tools = SimulatedTools(loop.time, workers=1)
        running = asyncio.create_task(tools.run("a", 0, None, None, 5.0))
        queued = asyncio.create_task(tools.run("b", 0, None, None, 1.0))
        last = asyncio.create_task(tools.run("c", 0, None, None, 1.0))
        await asyncio.sleep(1.0)
        queued.cancel()  # leaves the queue
        running.cancel()  # frees the core: c starts now
        r = await last
        for t in (running, queued):
            with pytest.raises(asyncio.CancelledError):
                await t
        return r, tools

    r, tools = run_virtual(main())
    assert (r.start_ts, r.end_ts) == (1.0, 2.0)
    assert tools._free == 1 and not tools._queue and tools.stats().in_flight == 0


def test_bad_worker_counts_are_refused():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="workers must be a positive integer"):
            SimulatedTools(lambda: 0.0, bad)


def _tool_heavy(path: Path, n: int = 8) -> Path:
    """Short calls around long tools: the tools, not KV, are the bottleneck on two cores."""
    lines = []
    for i in range(n):
        turns = [{"output_tokens": 20, "tool_s": 6.0, "tool": "test"},
                 {"append_tokens": 50, "output_tokens": 20, "tool_s": 4.0 + i % 3, "tool": "bash"},
                 {"append_tokens": 30, "output_tokens": 10}]
        lines.append(json.dumps({"schema": "mars_workload_v1", "workflow_id": f"t{i}", "prompt_tokens": 400 + 10 * i,
                                 "turns": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_tool_bound_sim_cell_queues_tools_and_feeds_the_cpu_signal(tmp_path):
    wl = _tool_heavy(tmp_path / "wl.jsonl")
    out = {}
    for name, cpu_tool in (("free", None), ("two", "0-1")):
        d, _ = run_replay(ReplayConfig(workload=str(wl), policy="mars", rps=4.0, backend="sim",
                                       profile="h200-qwen3-coder-30b-a3b", cpu_tool=cpu_tool, progress=False,
                                       plots=False, out=str(tmp_path / name)))
        out[name] = d
    free, two = (json.loads((out[k] / "summary.json").read_text()) for k in ("free", "two"))
    assert free["completed"] == two["completed"] == 8 and two["engine"]["leak_check"] == "ok"
    waits = [e["wait_s"] for e in read_events(out["two"]) if e["event"] == "tool_end"]
    assert max(waits) > 1.0, "16 tool calls of 4-6 s on two cores must queue"
    assert all(e["wait_s"] == 0 for e in read_events(out["free"]) if e["event"] == "tool_end")
    assert two["e2e_s"]["mean"] > free["e2e_s"]["mean"] * 1.3
    samples = [e for e in read_events(out["two"]) if e["event"] == "kv_sample"]
    assert any((e.get("tools_in_flight") or 0) > 2 for e in samples), "the telemetry sees tools beyond the cores"
    # mars's admission caps the active roots at ceil(1.5 x cores) (>= window_min 4) where the tool plane
    # has cores, and nowhere else; the queue wait is no pressure (experiments/paper/cpu_tool.toml)
    active = {k: max(e["active"] for e in read_events(out[k]) if e["event"] == "kv_sample") for k in ("free", "two")}
    assert active["free"] > 4 >= active["two"]
    assert not [e for k in ("free", "two") for e in read_events(out[k]) if e["event"] == "admission_pressure"]
    # an experiment's record carries the tool plane and the KV pool (what a tool-bound cell is read by)
    rec = compare_record("wl", {4.0: {"free": free, "two": two}})["cells"][0]["policies"]
    assert rec["free"]["mean_tool_wait_s"] == 0 and rec["two"]["mean_tool_wait_s"] == two["tools"]["mean_wait_s"] > 0
    assert 0 < rec["two"]["kv_usage_mean"] <= rec["two"]["kv_usage_max"] == two["kv_usage"]["max"] < 1
    assert rec["two"]["p95_admission_wait_s"] == two["admission"]["wait_s"]["p95"]


@pytest.mark.parametrize(("label", "scheduler"), [("continuum-concur", "continuum"),
                                                  ("continuum_dy-concur", "continuum_dy")])
def test_the_concur_pairings_run_concur_admission_in_front_of_continuum(tmp_path, label, scheduler):
    d, _ = run_replay(ReplayConfig(workload=str(_tool_heavy(tmp_path / "wl.jsonl", n=4)), policy=label, rps=4.0,
                                   backend="sim", profile="h200-qwen3-coder-30b-a3b", progress=False, plots=False,
                                   out=str(tmp_path / label)))
    start = next(e for e in read_events(d) if e["event"] == "run_start")
    assert (start["scheduler_policy"], start["controller"]) == (scheduler, "concur")
    summary = json.loads((d / "summary.json").read_text())
    assert summary["completed"] == 4 and summary["engine"]["leak_check"] == "ok"
