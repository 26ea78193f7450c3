"""Issue 11, driver side (defect 10): a timed-out call is aborted in the engine, in-process telemetry
goes stale when the engine is not seen alive, and ``Replay.run`` ends with a worker's error instead of
hanging. Real in-process vLLM engine (tiny model), one per module."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from vllm_mars.driver.backends import InProcessBackend
from vllm_mars.driver.runner import DEFAULT_WORKLOAD, Replay, ReplayConfig, RunClock
from vllm_mars.engine.rig import assert_no_leaks
from vllm_mars.workload.materialize import load_plans


@pytest.fixture(scope="module")
def backend_loop(tiny_model, tmp_path_factory):
    """A started in-process backend (mars policy, MARS_SCHED_LOG on) and the event loop it lives on."""
    import os

    log = tmp_path_factory.mktemp("sched") / "sched.jsonl"
    os.environ["MARS_SCHED_LOG"] = str(log)
    loop = asyncio.new_event_loop()
    clock = RunClock()
    b = InProcessBackend(tiny_model, clock, policy="mars", num_blocks=64, block_size=32, max_model_len=2000,
                         max_num_seqs=8, max_num_batched_tokens=512)
    try:
        loop.run_until_complete(b.start())
    finally:
        del os.environ["MARS_SCHED_LOG"]
    yield b, loop, log
    loop.run_until_complete(b.close())
    loop.close()


def _ended(log, rid: str) -> dict | None:
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "end" and rec["request_id"].startswith(rid):
            return rec
    return None


def test_a_timed_out_call_is_aborted_in_the_engine(backend_loop):
    b, loop, log = backend_loop

    async def go():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(b.generate("slow-1", list(range(10, 60)), 1900, {}), 0.3)
        for _ in range(100):
            if not b.scheduler.requests:
                break
            await asyncio.sleep(0.02)

    loop.run_until_complete(go())
    end = _ended(log, "slow-1")
    assert end is not None and end["aborted"] is True and end["output_tokens"] < 1900, end
    assert_no_leaks(b.scheduler)


def test_replay_run_ends_with_the_error_of_a_failed_worker(backend_loop, tmp_path):
    """``_arrivals`` raising used to leave ``run`` waiting for roots that never come."""
    b, loop, _ = backend_loop
    cfg = ReplayConfig(workload=str(DEFAULT_WORKLOAD), policy="fcfs", progress=False, calibrate=False, rps=0.5,
                       tools="real", sandbox="landlock", tool_net_allow=[8000])
    plans = load_plans(cfg.workload)[:2]

    async def go():
        replay = Replay(cfg, tmp_path, b, plans, [0.0, 1.0], RunClock(), None)

        def offer(root):
            raise RuntimeError("offer failed")

        replay.ctrl.offer = offer  # fault injection: the arrival loop's first offer raises
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="offer failed"):
            await asyncio.wait_for(replay.run(), 10)
        replay.events.close()
        return time.monotonic() - t

    assert loop.run_until_complete(go()) < 5
    assert_no_leaks(b.scheduler)
    # Defect 12: the run's events say which tool protections were in force.
    start = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[0])
    prot = start["sandbox_protections"]
    assert start["event"] == "run_start" and prot["mode"] == "landlock" == start["sandbox"]
    from vllm_mars.driver._sandbox_exec import landlock_abi

    tcp = "denied except connect to ports [8000]" if landlock_abi() >= 4 else "allowed (Landlock ABI < 4 cannot deny it)"
    assert prot["tcp"] == tcp and prot["writes"], prot


def test_inprocess_telemetry_is_fresh_while_alive_and_stale_once_the_stepper_dies(backend_loop, monkeypatch):
    b, loop, _ = backend_loop

    async def go():
        s1 = b.sample()
        await asyncio.sleep(0.3)
        s2 = b.sample()
        assert s2.ts > s1.ts and b.clock() - s2.ts < 0.2, (s1.ts, s2.ts, b.clock())  # idle but alive
        # Kill the stepper thread through the engine: its next step raises.
        monkeypatch.setattr(b.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("engine died")))
        with pytest.raises(RuntimeError, match="engine died"):
            await asyncio.wait_for(b.generate("dies-1", list(range(10, 40)), 4, {}), 10)
        b._thread.join(5)
        assert not b._thread.is_alive()
        s3 = b.sample()
        await asyncio.sleep(0.3)
        assert b.sample().ts == s3.ts and b.clock() - s3.ts >= 0.3  # stale, as it should be

    loop.run_until_complete(go())


def test_real_engine_pause_sleep_and_wake_release_retention(tiny_model):
    """Defect 11 on vLLM's own EngineCore: pause(clear_cache) and sleep(level 1) reset the prefix cache
    with running requests, which failed while the mars policy held retained KV."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_mars.engine.local import engine_kwargs

    e = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(
        tiny_model, policy="mars", num_blocks=64, block_size=32, max_model_len=1024, max_num_seqs=4,
        max_num_batched_tokens=256, disable_log_stats=True)))
    core = e.engine_core.engine_core
    s = core.scheduler
    try:
        tagged = SamplingParams(max_tokens=4, ignore_eos=True,
                                extra_args={"mars_workflow": "w", "mars_turn": 0, "mars_last_step": False})
        e.add_request("w-0", {"prompt_token_ids": list(range(10, 120))}, tagged)
        while e.has_unfinished_requests():
            e.step()
        assert s.retention.num_blocks > 0
        e.add_request("b", {"prompt_token_ids": list(range(10, 200))}, SamplingParams(max_tokens=40, ignore_eos=True))
        e.step()
        assert s.running
        core.pause_scheduler(mode="keep", clear_cache=True)  # preempts "b", resets the prefix cache
        assert s.retention.num_blocks == 0 and not s.running and len(s.waiting) == 1
        core.resume_scheduler()
        while e.has_unfinished_requests():
            e.step()
        e.add_request("w-1", {"prompt_token_ids": list(range(10, 130))}, tagged)
        while e.has_unfinished_requests():
            e.step()
        core.sleep(level=1)  # pause(abort, clear_cache) + offload
        assert s.retention.num_blocks == 0
        assert core.wake_up() is True
        e.add_request("c", {"prompt_token_ids": list(range(10, 60))}, SamplingParams(max_tokens=3, ignore_eos=True))
        while e.has_unfinished_requests():
            e.step()
        assert_no_leaks(s)
    finally:
        core.shutdown()
