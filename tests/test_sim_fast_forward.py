"""The sim's fast-forward changes nothing: byte-identical ``summary.json`` and ``events.jsonl`` with it
on and off, across policies, on a pool small enough that calls queue, are preempted, and evict each
other's prefixes (each run ends with the sim's leak check). It must also run most steps, steps
during which a timer fires, steps beside calls that wait and cannot start, and steps that carry a
running call's prefill chunk among them, or the speed it buys is not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.engine import rig
from vllm_mars.sim import engine as sim_engine

PROFILE = "h200-qwen3-coder-30b-a3b"


def _workload(path: Path, n: int = 10) -> Path:
    """``n`` workflows, 3-4 turns of 30-260 output tokens around 0.3-4 s tools, a shared prefix, one
    child: contexts of 1-3k tokens against a 5k-token pool."""
    lines = []
    for i in range(n):
        turns = [{"output_tokens": 60 + 23 * i, "tool_s": 0.3 + 0.4 * (i % 5), "tool": "bash"},
                 {"append_tokens": 200 + 40 * i, "output_tokens": 30 + 11 * (i % 4), "tool_s": 2.0 + 0.5 * (i % 3),
                  "tool": "read"},
                 {"append_tokens": 64, "output_tokens": 260 - 13 * i}]
        if i % 3 == 0:
            turns.insert(2, {"append_tokens": 500, "output_tokens": 45, "tool_s": 4.0, "tool": "test"})
        wf = {"schema": "mars_workload_v1", "workflow_id": f"w{i}", "prefix": [{"tokens": 512, "key": "sys"}],
              "prompt_tokens": 900 + 97 * i, "turns": turns}
        if i == 2:
            wf["children"] = [{"after_turn": 0, "workflow": {
                "workflow_id": "w2.c0", "prompt_tokens": 300,
                "turns": [{"output_tokens": 70, "tool_s": 1.0, "tool": "bash"},
                          {"append_tokens": 40, "output_tokens": 25}]}}]
        lines.append(json.dumps(wf))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tmp_path: Path, policy: str, fast: bool, monkeypatch) -> tuple[Path, list]:
    monkeypatch.setattr(sim_engine.SimBackend, "fast_forward", fast)
    backends = []
    start = sim_engine.SimBackend.start

    async def recording_start(self):
        backends.append(self)
        return await start(self)

    monkeypatch.setattr(sim_engine.SimBackend, "start", recording_start)
    wl = tmp_path / "wl.jsonl"
    if not wl.exists():
        _workload(wl)
    out, _ = run_replay(ReplayConfig(workload=str(wl), policy=policy, rps=1.5, backend="sim", profile=PROFILE,
                                     num_blocks=330, progress=False, out=str(tmp_path / f"{policy}-{fast}")))
    return out, backends


@pytest.mark.parametrize("policy", ["mars", "fcfs", "continuum", "infercept", "autellix", "lightllm",
                                    "mars-no-admission"])
def test_fast_forward_gives_byte_identical_runs(tmp_path, monkeypatch, policy):
    on, backends = _run(tmp_path, policy, True, monkeypatch)
    off, off_backends = _run(tmp_path, policy, False, monkeypatch)
    assert (on / "summary.json").read_bytes() == (off / "summary.json").read_bytes()
    assert (on / "events.jsonl").read_bytes() == (off / "events.jsonl").read_bytes()
    summary = json.loads((on / "summary.json").read_text())
    assert summary["completed"] == 10 and summary["errors"] == 0
    assert summary["engine"]["leak_check"] == "ok"
    # the cell is not trivial: the pool evicts prefixes (and, without admission, preempts)
    assert summary["engine"]["kv_blocks_removed"] > 0
    run = max(backends, key=lambda b: b.steps)  # the replay's engine (not a calibration engine)
    assert run.ff_steps > run.steps / 3, f"fast-forward ran {run.ff_steps} of {run.steps} steps"
    # steps across a timer (the sampler every virtual second, tools, the admission tick) run too
    assert run.ff_crossed > 0
    off_run = max(off_backends, key=lambda b: b.steps)
    assert off_run.ff_steps == 0 and off_run.steps == run.steps
    # calls wait that cannot start (the pool is small): the steps beside them run too
    assert run.ff_waiting > run.ff_steps / 5, f"{run.ff_waiting} of {run.ff_steps} beside waiting calls"
    # runs of decode-only steps are applied at once (``SimBackend._decode_run``) where the policy's
    # step hooks allow it: all but autellix, whose quanta and promotions move with every step
    if policy == "autellix":
        assert run.ff_bulk == 0
    else:
        assert run.ff_bulk > run.steps / 3, f"{run.ff_bulk} of {run.steps} steps applied in runs"


def test_a_preempting_cell_is_identical_too(tmp_path, monkeypatch):
    """fcfs on an even smaller pool: preemptions happen, calls wait that cannot start (the fast-forward
    runs the decode steps beside them), and runs stay identical."""
    wl = _workload(tmp_path / "wl.jsonl")
    outs, runs = [], []
    start = sim_engine.SimBackend.start

    async def recording_start(self):
        runs.append(self)
        return await start(self)

    monkeypatch.setattr(sim_engine.SimBackend, "start", recording_start)
    for fast in (True, False):
        monkeypatch.setattr(sim_engine.SimBackend, "fast_forward", fast)
        out, _ = run_replay(ReplayConfig(workload=str(wl), policy="fcfs", rps=4.0, backend="sim", profile=PROFILE,
                                         num_blocks=260, progress=False, out=str(tmp_path / f"p{fast}")))
        outs.append(out)
    assert (outs[0] / "summary.json").read_bytes() == (outs[1] / "summary.json").read_bytes()
    assert (outs[0] / "events.jsonl").read_bytes() == (outs[1] / "events.jsonl").read_bytes()
    assert json.loads((outs[0] / "summary.json").read_text())["preemptions"] > 0
    fast_run = max((b for b in runs if b.ff_steps), key=lambda b: b.steps)
    assert fast_run.ff_waiting > 0, "no decode step beside a waiting call was fast-forwarded"
    assert fast_run.ff_bulk > fast_run.steps / 8, f"{fast_run.ff_bulk} of {fast_run.steps} steps applied in runs"


def _long_workload(path: Path, first_output: int) -> Path:
    """8 workflows of 9-25k-token prompts and a 6-12k-token second turn (prefills of several 8192-token
    chunks), a shared 2k-token prefix, 0.5-2 s tools."""
    lines = []
    for i in range(8):
        turns = [{"output_tokens": first_output + 7 * i, "tool_s": 0.5 + 0.3 * (i % 4), "tool": "bash"},
                 {"append_tokens": 6000 + 1500 * (i % 5), "output_tokens": 30 + 5 * (i % 3), "tool_s": 1.0,
                  "tool": "read"},
                 {"append_tokens": 300, "output_tokens": 50}]
        lines.append(json.dumps({"schema": "mars_workload_v1", "workflow_id": f"w{i}",
                                 "prefix": [{"tokens": 2048, "key": "sys"}], "prompt_tokens": 9000 + 2300 * i,
                                 "turns": turns}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("policy", "num_blocks", "rps", "first_output"), [
    ("mars", 4000, 1.0, 40), ("fcfs", 4000, 1.0, 40), ("continuum", 4000, 1.0, 40),
    ("autellix", 2400, 2.0, 40), ("infercept", 2400, 2.0, 40),
    ("fcfs", 2400, 4.0, 900),  # preempts
    ("mars", 2400, 4.0, 900),
])
def test_steps_with_prefill_chunks_are_fast_forwarded_identically(tmp_path, monkeypatch, policy, num_blocks, rps,
                                                                  first_output):
    """Steps whose running set holds a call's later prefill chunks (the first chunk is an admission,
    on the full path) run in the fast-forward for the most part, with identical results."""
    wl = _long_workload(tmp_path / "wl.jsonl", first_output)
    runs = []
    start = sim_engine.SimBackend.start

    async def recording_start(self):
        runs.append(self)
        return await start(self)

    monkeypatch.setattr(sim_engine.SimBackend, "start", recording_start)
    chunk_steps = [0]  # full-path steps with a running call's prefill chunk and no admission
    shape = rig.batch_shape

    def counting_shape(s, so):
        prefill, decode = shape(s, so)
        if prefill and not so.scheduled_new_reqs and not so.scheduled_cached_reqs.resumed_req_ids:
            chunk_steps[0] += 1
        return prefill, decode

    monkeypatch.setattr(rig, "batch_shape", counting_shape)
    outs, counts = [], []
    for fast in (True, False):
        monkeypatch.setattr(sim_engine.SimBackend, "fast_forward", fast)
        chunk_steps[0] = 0
        out, _ = run_replay(ReplayConfig(workload=str(wl), policy=policy, rps=rps, backend="sim", profile=PROFILE,
                                         num_blocks=num_blocks, progress=False, out=str(tmp_path / f"r{fast}")))
        outs.append(out)
        counts.append(chunk_steps[0])
    assert (outs[0] / "summary.json").read_bytes() == (outs[1] / "summary.json").read_bytes()
    assert (outs[0] / "events.jsonl").read_bytes() == (outs[1] / "events.jsonl").read_bytes()
    summary = json.loads((outs[0] / "summary.json").read_text())
    assert summary["completed"] == 8 and summary["errors"] == 0
    assert summary["engine"]["leak_check"] == "ok"
    if first_output > 100 and policy == "fcfs":
        assert summary["preemptions"] > 0
    fast_run = max((b for b in runs if b.ff_steps), key=lambda b: b.steps)
    off_run = max((b for b in runs if not b.ff_steps), key=lambda b: b.steps)
    assert fast_run.steps == off_run.steps
    # the off run computed that many chunks of running calls on vLLM's schedule(); the fast-forward
    # took most of them (the rest: a possible allocation failure or admission, on the full path)
    assert counts[1] >= 25, counts
    assert fast_run.ff_prefill >= 0.6 * counts[1], (fast_run.ff_prefill, counts)
    assert fast_run.ff_prefill + counts[0] == counts[1], (fast_run.ff_prefill, counts)
