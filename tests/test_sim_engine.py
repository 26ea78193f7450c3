"""The virtual-time engine: the loop, exact step charging, same decisions as the rig, determinism,
leak checks, the CLI, and a large pool without tensors. Each sim run ends with the leak check."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from pathlib import Path

import pytest
from sim_profiles import ConstantProfile, LinearProfile, use_profiles
from vllm_mars.clock import VirtualClock
from vllm_mars.driver.runner import ReplayConfig, RunClock, run_replay
from vllm_mars.engine.rig import assert_no_leaks, fake_model_output, make_request, make_scheduler
from vllm_mars.metrics.events import read_events
from vllm_mars.sim.engine import SimBackend
from vllm_mars.sim.loop import run_virtual

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def linear_profile(monkeypatch):
    """``--profile test-linear`` resolves to the linear test profile (until shipped profiles exist)."""
    linear = LinearProfile()
    use_profiles(monkeypatch, linear, ConstantProfile())
    return linear


def _workload(path: Path, n: int = 8) -> Path:
    """``n`` workflows sharing a 256-token system prefix, 3 turns with tools (0.5-3 s), one child."""
    lines = []
    for i in range(n):
        turns = [{"output_tokens": 40 + 7 * i, "tool_s": 0.5 + 0.25 * i, "tool": "bash"},
                 {"append_tokens": 64 + 16 * i, "output_tokens": 30, "tool_s": 3.0, "tool": "read"},
                 {"append_tokens": 32, "output_tokens": 50}]
        wf = {"schema": "mars_workload_v1", "workflow_id": f"w{i}", "prefix": [{"tokens": 256, "key": "sys"}],
              "prompt_tokens": 300 + 40 * i, "turns": turns}
        if i == 1:
            wf["children"] = [{"after_turn": 0, "workflow": {
                "workflow_id": "w1.c0", "prompt_tokens": 120,
                "turns": [{"output_tokens": 20, "tool_s": 1.0, "tool": "bash"},
                          {"append_tokens": 20, "output_tokens": 10}]}}]
        lines.append(json.dumps(wf))
    path.write_text("\n".join(lines) + "\n")
    return path


# -- the loop -----------------------------------------------------------------------------------------
def test_virtual_loop_runs_timers_in_virtual_time_without_waiting():
    async def main():
        loop = asyncio.get_running_loop()

        async def after(d):
            await asyncio.sleep(d)
            return loop.time()

        got = await asyncio.gather(after(7200.0), after(5.0), after(0.25))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100.0), 2.0)
        return got, loop.time()

    t = time.monotonic()
    got, end = run_virtual(main())
    assert got == [7200.0, 5.0, 0.25] and end == 7202.0
    assert time.monotonic() - t < 2.0, "two virtual hours must not take wall time"


def test_run_clock_reads_the_loop_and_has_no_wall_epoch_in_virtual_time():
    async def main():
        clock = RunClock.of_loop(asyncio.get_running_loop())
        await asyncio.sleep(3.0)
        return clock(), clock.epoch

    assert run_virtual(main()) == (3.0, None)
    real = asyncio.run(asyncio.sleep(0, RunClock.of_loop(asyncio.new_event_loop())))
    assert real.epoch is not None and not real.virtual


# -- the engine ---------------------------------------------------------------------------------------
def test_a_step_charges_exactly_what_the_profile_says():
    p = LinearProfile()

    async def main():
        backend = SimBackend(p, asyncio.get_running_loop().time, policy="fcfs")
        await backend.start()
        a = asyncio.create_task(backend.generate("a", [7] * 100, 3, {}))
        b = asyncio.create_task(backend.generate("b", [9] * 200, 3, {}))
        ra, rb = await asyncio.gather(a, b)
        stats = backend.engine_stats()
        await backend.close()
        return ra, rb, stats

    ra, rb, stats = run_virtual(main())
    # by hand: step 1 prefills both prompts from scratch (300 tokens <= the 512 budget) ...
    t1 = 0.004 + (100 * 2e-4) + (200 * 2e-4)
    # ... steps 2 and 3 decode both, over contexts 100/200 then 101/201 tokens
    t2 = 0.004 + 2 * 1e-3 + (100 + 200) * 1e-7
    t3 = 0.004 + 2 * 1e-3 + (101 + 201) * 1e-7
    assert p.step_seconds([(100, 0), (200, 0)], []) == pytest.approx(t1, abs=1e-15)
    for r in (ra, rb):
        assert r.first_token_ts == pytest.approx(t1, abs=1e-12)
        assert r.end_ts == pytest.approx(t1 + t2 + t3, abs=1e-12)
        assert len(r.output_ids) == 3 and r.cached_tokens == 0 and r.finish_reason == "length"
    assert stats["steps"] == 3 and stats["busy_s"] == pytest.approx(t1 + t2 + t3, abs=1e-6)
    assert stats["leak_check"] == "ok"


def _requests(wave: int):
    """Seeded-by-hand requests: a shared 64-token prefix, different lengths and outputs."""
    prefix = [5 + (j * 13) % 3000 for j in range(64)]
    out = []
    for i in range(6):
        ids = prefix + [100 + wave * 1000 + i * 37 + (j * 7) % 500 for j in range(90 + 60 * i)]
        out.append((f"w{wave}r{i}", ids, 20 + 9 * i, {"mars_workflow": f"wf{wave}{i}", "mars_turn": 0}))
    return out


@pytest.mark.parametrize(("policy", "options"), [("fcfs", None), ("mars", {"reserve_prefills": False})])
def test_sim_makes_the_same_decisions_as_the_rig_given_the_same_step_times(policy, options):
    """The rig steps vLLM's scheduler with a fixed step time; the sim charges the same constant step
    from its profile: scheduled tokens per step, preemptions and finish order must be identical."""
    prof = ConstantProfile(capacity_tokens=48 * 16, max_num_batched_tokens=256, max_num_seqs=8)
    dt, wave2_step = prof.step_s, 11

    # the rig: the real scheduler, a virtual clock, fake outputs
    clock = VirtualClock()
    # (mars without its prefill reserve: with it, this pool forces no preemption at all)
    s = make_scheduler(policy, num_blocks=prof.num_kv_blocks(), block_size=prof.block_size,
                       max_num_seqs=prof.max_num_seqs, max_num_batched_tokens=prof.max_num_batched_tokens,
                       max_model_len=prof.max_model_len, clock=clock, kv_events=True, log_stats=False,
                       policy_options=options)
    rig_steps, rig_done, step_no = [], [], 0
    pending = {0: _requests(0), wave2_step: _requests(1)}
    while s.has_requests() or pending:
        for rid, ids, n, extra in pending.pop(step_no, []):
            s.add_request(make_request(rid, prompt_token_ids=ids, max_tokens=n, extra_args=extra,
                                       block_size=prof.block_size, arrival_time=clock.now()))
        so = s.schedule()
        rig_steps.append(dict(so.num_scheduled_tokens))
        clock.set(clock.now() + dt)
        outs = s.update_from_output(so, fake_model_output(s, so))
        rig_done += [o.request_id for eco in outs.values() for o in eco.outputs if o.finish_reason is not None]
        step_no += 1
    rig_preempted = s.mars_num_preemptions
    s.release_retention()
    assert_no_leaks(s)

    # the sim: the same requests at the same step boundaries, on the virtual-time loop
    async def main():
        loop = asyncio.get_running_loop()
        backend = SimBackend(prof, loop.time, policy=policy, policy_options=options)
        await backend.start()
        steps, sched = [], backend.scheduler
        end_step = sched._mars_end_step

        def recording_end_step(out, now):  # every step's end: schedule()'s and the decode fast-forward's
            steps.append(dict(out.num_scheduled_tokens))
            return end_step(out, now)

        sched._mars_end_step = recording_end_step
        decode_steps = sched._mars_decode_steps

        def recording_decode_steps(k, last_now):  # a run of decode-only steps at once (one token each)
            steps.extend({r.request_id: 1 for r in sched.running} for _ in range(k))
            return decode_steps(k, last_now)

        sched._mars_decode_steps = recording_decode_steps
        done: list[str] = []

        async def call(rid, ids, n, extra):
            await backend.generate(rid, ids, n, extra)
            done.append(rid)

        tasks = [asyncio.create_task(call(*r)) for r in _requests(0)]
        await asyncio.sleep((wave2_step - 0.5) * dt)  # mid-step 10: joins at step 11's start
        tasks += [asyncio.create_task(call(*r)) for r in _requests(1)]
        await asyncio.gather(*tasks)
        preempted = sched.mars_num_preemptions
        await backend.close()
        return steps, done, preempted

    sim_steps, sim_done, sim_preempted = run_virtual(main())
    assert rig_preempted > 0, "the pool must force preemptions for this check to mean something"
    assert sim_steps == rig_steps
    assert sim_done == rig_done
    assert sim_preempted == rig_preempted


def test_an_aborted_call_leaves_the_engine_and_a_leak_is_an_error():
    p = LinearProfile()

    async def main():
        backend = SimBackend(p, asyncio.get_running_loop().time)
        await backend.start()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(backend.generate("slow", [3] * 300, 2000, {}), 0.5)
        ok = await backend.generate("fast", [4] * 50, 2, {})
        assert "slow" not in backend.scheduler.requests
        await backend.close()  # clean: no raise

        leaky = SimBackend(p, asyncio.get_running_loop().time)
        await leaky.start()
        leaky.scheduler.kv_cache_manager.block_pool.get_new_blocks(1)  # a block nobody owns
        with pytest.raises(RuntimeError, match="KV blocks leaked"):
            await leaky.close()
        return ok

    assert len(run_virtual(main()).output_ids) == 2


def test_a_700k_token_pool_costs_no_kv_memory():
    """H200-scale pool (700k tokens in 16-token blocks): bookkeeping only, no tensors."""
    p = LinearProfile(capacity_tokens=700_000, max_model_len=32768, max_num_batched_tokens=8192,
                      max_num_seqs=256)

    async def main():
        backend = SimBackend(p, asyncio.get_running_loop().time)
        tracemalloc.start()
        await backend.start()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        r = await backend.generate("big", [11] * 30000, 4, {})
        free = backend.sample().free_blocks
        await backend.close()
        return peak, r, free

    peak, r, free = run_virtual(main())
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB for a 700k-token pool"  # 700k bf16 KV would be ~67 GB
    assert len(r.output_ids) == 4 and free == 700_000 // 16 - 1


# -- the driver on the sim ----------------------------------------------------------------------------
def _sim_cfg(tmp_path: Path, name: str, policy: str = "mars", **kw) -> ReplayConfig:
    return ReplayConfig(workload=str(_workload(tmp_path / "wl.jsonl")), policy=policy, rps=2.0, backend="sim",
                        profile="test-linear", progress=False, out=str(tmp_path / name), **kw)


def test_sim_replay_is_deterministic_and_leak_free(tmp_path, linear_profile):
    a, _ = run_replay(_sim_cfg(tmp_path, "a"))
    b, _ = run_replay(_sim_cfg(tmp_path, "b"))
    assert (a / "summary.json").read_bytes() == (b / "summary.json").read_bytes()
    assert (a / "events.jsonl").read_bytes() == (b / "events.jsonl").read_bytes()
    summary = json.loads((a / "summary.json").read_text())
    assert summary["completed"] == 8 and summary["errors"] == 0 and summary["backend"] == "sim"
    assert summary["prefix_hit_rate"] > 0.3, "later turns and the shared prefix hit vLLM's prefix cache"
    events = read_events(a)
    end = [e for e in events if e["event"] == "run_end"][-1]["engine"]
    assert end["leak_check"] == "ok" and end["free_blocks"] == end["num_blocks"] and end["retained_blocks"] == 0
    assert end["profile"] == "test-linear" and end["steps"] > 0
    start = events[0]
    assert start["event"] == "run_start" and start["epoch"] is None
    # the engine shape is the profile's, recorded in run_config.json
    rc = json.loads((a / "run_config.json").read_text())
    assert (rc["num_blocks"], rc["block_size"], rc["max_num_batched_tokens"]) == (120, 16, 512)
    # kv_sample every virtual second; the run spans tens of virtual seconds in well under that of wall time
    samples = [e["ts"] for e in events if e["event"] == "kv_sample"]
    assert len(samples) >= 5 and samples[2] - samples[1] == pytest.approx(1.0)


def test_a_run_that_calibrates_starts_from_the_state_of_one_handed_the_model(tmp_path, linear_profile):
    # The calibration's solo calls once ran on the run's own engine: its prompts sat in the prefix
    # cache (evicted during the run: KV removals nobody rebuilds) and its calls in the policy's
    # learned state, so only the first run of a comparison (the one that calibrates) started so.
    a, cost = run_replay(_sim_cfg(tmp_path, "a"))
    b, _ = run_replay(_sim_cfg(tmp_path, "b"), cost)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for key in ("e2e_s", "ttft_s", "goodput_wps", "preemptions", "recomputed_tokens", "prefix_hit_rate"):
        assert sa[key] == sb[key], key
    # and on the same timeline, bit for bit: the calibration's virtual seconds are rewound before the run
    # (left on the loop, every timestamp came out a float's width off: 0.19999999999999996 for 0.2)
    assert (a / "events.jsonl").read_bytes() == (b / "events.jsonl").read_bytes()
    first = next(e for e in read_events(a) if e["event"] == "kv_sample")
    assert first["kv_blocks_removed"] == 0 and first["free_blocks"] == first["total_blocks"]


def test_skipping_the_loop_between_steps_changes_nothing(tmp_path, linear_profile, monkeypatch):
    """The engine advances the clock inline when nothing else would run during a step; a run that
    always sleeps through the loop instead writes the very same events."""
    from vllm_mars.sim.loop import VirtualTimeLoop

    inline = []
    advance = VirtualTimeLoop.advance_if_idle
    monkeypatch.setattr(VirtualTimeLoop, "advance_if_idle", lambda self, dt: inline.append(advance(self, dt))
                        or inline[-1])
    fast, _ = run_replay(_sim_cfg(tmp_path, "fast"))
    assert sum(inline) > 100, "most steps of this run pass while everything else sleeps"
    monkeypatch.setattr(VirtualTimeLoop, "advance_if_idle", lambda self, dt: False)
    monkeypatch.setattr(VirtualTimeLoop, "idle_for", lambda self, dt: False)  # (no decode fast-forward either)
    slow, _ = run_replay(_sim_cfg(tmp_path, "slow"))
    assert (fast / "events.jsonl").read_bytes() == (slow / "events.jsonl").read_bytes()


def test_cli_replay_and_compare_on_the_sim(tmp_path, linear_profile, capsys):
    from vllm_mars.cli import main

    wl = _workload(tmp_path / "wl.jsonl", n=4)
    assert main(["replay", "--backend", "sim", "--profile", "test-linear", "--workload", str(wl), "--policy",
                 "fcfs", "--rps", "2", "--no-progress", "--out", str(tmp_path / "r")]) == 0
    assert "| fcfs | 4/4 |" in capsys.readouterr().out
    assert main(["compare", "--backend", "sim", "--profile", "test-linear", "--workload", str(wl), "--policies",
                 "mars,fcfs", "--rps", "2", "--no-progress", "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "vs fcfs" in out and "| 2.00 | mars |" in out
    record = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert record["config"]["backend"] == "sim" and record["config"]["profile"] == "test-linear"
    # bad combinations are one-line errors with exit 2
    assert main(["replay", "--backend", "sim", "--workload", str(wl)]) == 2
    assert "needs --profile" in capsys.readouterr().err
    assert main(["replay", "--backend", "sim", "--profile", "test-linear", "--block-size", "32",
                 "--workload", str(wl)]) == 2
    assert "--block-size: the sim backend takes the engine shape from --profile" in capsys.readouterr().err
    assert main(["replay", "--backend", "sim", "--profile", "nope", "--workload", str(wl)]) == 2
    assert "profile 'nope' unknown" in capsys.readouterr().err


def test_prefix_reusing_hasher_gives_vllms_block_hashes():
    from vllm_mars.engine.rig import PrefixReusingHasher

    turn0 = [3 + (j * 31) % 3000 for j in range(1000)]
    prev = make_request("t0", prompt_token_ids=turn0, max_tokens=5, block_size=16)
    prev.append_output_token_ids([42] * 37)  # the call's output extends its hashed blocks
    turn1 = list(prev.all_token_ids) + [7 + j % 900 for j in range(333)]
    hasher = PrefixReusingHasher(16)
    hasher.hint("t1", prev.all_token_ids, prev.block_hashes)
    fast = make_request("t1", prompt_token_ids=turn1, max_tokens=5, block_size=16, block_hasher=hasher)
    slow = make_request("t1", prompt_token_ids=turn1, max_tokens=5, block_size=16)
    assert fast.block_hashes == slow.block_hashes and len(fast.block_hashes) == len(turn1) // 16
    assert hasher.reused == len(prev.all_token_ids) // 16
    # a hint that does not match the prompt is ignored (vLLM's hasher does all the work)
    hasher.hint("t2", [1] * 640, prev.block_hashes)
    other = make_request("t2", prompt_token_ids=turn1, max_tokens=5, block_size=16, block_hasher=hasher)
    assert other.block_hashes == slow.block_hashes and hasher.reused == len(prev.all_token_ids) // 16
    for _ in range(40):  # decode: one token at a time, each block hashed as it fills, as vLLM does
        fast.append_output_token_ids(42)
        slow.append_output_token_ids(42)
        assert fast.block_hashes == slow.block_hashes
    assert len(fast.block_hashes) == (len(turn1) + 40) // 16 > len(turn1) // 16
    # a first call (no hint): the whole prompt hashed by the lean loop, as vLLM's hasher hashes it
    for n in (15, 16, 17, 1000, 4099):
        ids = [3 + (j * 7919) % 4000 for j in range(n)]
        got = make_request(f"f{n}", prompt_token_ids=ids, max_tokens=5, block_size=16, block_hasher=hasher)
        want = make_request(f"f{n}", prompt_token_ids=ids, max_tokens=5, block_size=16)
        assert got.block_hashes == want.block_hashes and len(got.block_hashes) == n // 16


def test_block_removals_counted_without_events_equal_vllms_events():
    def removals(events: bool) -> int:
        s = make_scheduler("fcfs", num_blocks=40, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                           kv_events=events)
        if not events:
            s.count_block_removals()
        for wave in (0, 1, 0):  # the third wave re-sends wave 0's prompts: prefix hits and evictions
            for rid, ids, n, extra in _requests(wave):
                s.add_request(make_request(f"{rid}-{len(s.requests)}-{wave}", prompt_token_ids=ids,
                                           max_tokens=n, extra_args=extra))
            while s.has_requests():
                so = s.schedule()
                s.update_from_output(so, fake_model_output(s, so))
        n = s.mars_stats()["kv_blocks_removed"]
        assert_no_leaks(s)
        return n

    with_events = removals(True)
    assert with_events > 0 and removals(False) == with_events


@pytest.mark.slow
def test_sim_runs_are_byte_identical_across_processes_and_hash_seeds(tmp_path):
    """Two `mars replay --backend sim` processes with different PYTHONHASHSEED (set iteration order,
    str hashes) on a shipped GPU profile: identical summary.json and events.jsonl."""
    import os
    import subprocess
    import sys

    wl = _workload(tmp_path / "wl.jsonl", n=6)
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"run{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed, "VLLM_LOGGING_LEVEL": "ERROR"}
        subprocess.run([sys.executable, "-m", "vllm_mars.cli", "replay", "--backend", "sim", "--profile",
                        "h200-qwen3-coder-30b-a3b", "--workload", str(wl), "--policy", "mars", "--rps", "1",
                        "--no-progress", "--out", str(out)], env=env, check=True, capture_output=True, timeout=600)
        outs.append(out)
    assert (outs[0] / "summary.json").read_bytes() == (outs[1] / "summary.json").read_bytes()
    assert (outs[0] / "events.jsonl").read_bytes() == (outs[1] / "events.jsonl").read_bytes()


def test_compare_takes_admission_options_for_the_policies_whose_controller_has_them(tmp_path, linear_profile,
                                                                                    capsys):
    """``mars compare --admission-option`` (as ``mars replay`` takes it): the window reaches mars's
    controller and leaves fcfs (no admission) alone; a key no compared controller takes is refused."""
    from vllm_mars.cli import main

    wl = _workload(tmp_path / "wl.jsonl", n=4)
    common = ["compare", "--backend", "sim", "--profile", "test-linear", "--workload", str(wl), "--rps", "2",
              "--no-progress"]
    assert main([*common, "--policies", "mars,fcfs", "--admission-option", "window_min=1", "--admission-option", "window_max=1",
                 "--out", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    mars_cfg = json.loads((tmp_path / "c" / "rps2" / "mars" / "run_config.json").read_text())
    fcfs_cfg = json.loads((tmp_path / "c" / "rps2" / "fcfs" / "run_config.json").read_text())
    assert mars_cfg["admission_options"] == {"window_min": 1, "window_max": 1} and fcfs_cfg["admission_options"] == {}
    events = read_events(tmp_path / "c" / "rps2" / "mars")
    assert max(e["active"] for e in events if e["event"] == "kv_sample") <= 1, "a window of one root"
    assert main([*common, "--policies", "mars,fcfs", "--admission-option", "window_maxx=1",
                 "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "window_maxx" in err and "window_max" in err and not (tmp_path / "d" / "rps2").exists()
