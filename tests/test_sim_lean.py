"""The sim's costs outside the engine step, cut without changing what they give: the admission
tick's engine reading is read straight from the scheduler (``scheduler_reading``), not taken out of
the whole ``mars_stats()`` dict, and must equal the fields that dict reports at every reading of a
run that retains, evicts and preempts; the run's counters (``run_end``'s ``engine``) are still
``mars_stats()`` at the end."""

from __future__ import annotations

import json

from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.metrics.events import read_events
from vllm_mars.sim import engine as sim_engine

PROFILE = "h200-qwen3-coder-30b-a3b"


def _workload(path) -> None:
    """8 workflows of 3 turns around short tools, a shared prefix: contexts of 1-3k tokens against
    a 5k-token pool, so calls queue, are retained, evicted and preempted."""
    lines = []
    for i in range(8):
        turns = [{"output_tokens": 80 + 19 * i, "tool_s": 0.5 + 0.3 * (i % 4), "tool": "bash"},
                 {"append_tokens": 300 + 50 * i, "output_tokens": 40 + 9 * i, "tool_s": 1.5, "tool": "read"},
                 {"append_tokens": 64, "output_tokens": 200 - 11 * i}]
        lines.append(json.dumps({"schema": "mars_workload_v1", "workflow_id": f"w{i}",
                                 "prefix": [{"tokens": 512, "key": "sys"}], "prompt_tokens": 1000 + 90 * i,
                                 "turns": turns}))
    path.write_text("\n".join(lines) + "\n")


FIELDS = {"free_blocks": "free_blocks", "total_blocks": "num_blocks", "block_size": "block_size",
          "retained_blocks": "retained_blocks", "preemptions": "preemptions",
          "recomputed_tokens": "recomputed_tokens", "kv_blocks_removed": "kv_blocks_removed"}


def test_the_engine_reading_is_what_mars_stats_reports(tmp_path, monkeypatch):
    readings = []
    sample = sim_engine.SimBackend.sample

    def checked(self):
        got = sample(self)
        st = self.scheduler.mars_stats()
        s = self.scheduler
        want = {k: st[v] for k, v in FIELDS.items()}
        assert {k: getattr(got, k) for k in FIELDS} == want
        assert got.kv_usage == 1.0 - st["free_blocks"] / st["num_blocks"]
        assert (got.running, got.waiting) == (len(s.running), len(s.waiting))
        readings.append(want)
        return got

    monkeypatch.setattr(sim_engine.SimBackend, "sample", checked)
    wl = tmp_path / "wl.jsonl"
    _workload(wl)
    out, _ = run_replay(ReplayConfig(workload=str(wl), policy="mars-no-admission", rps=2.0, backend="sim",
                                     profile=PROFILE, num_blocks=330, progress=False, plots=False,
                                     out=str(tmp_path / "run")))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 8 and summary["engine"]["leak_check"] == "ok"
    # the readings saw the pool under pressure: blocks retained, evicted, calls preempted
    assert max(r["retained_blocks"] for r in readings) > 0
    assert readings[-1]["kv_blocks_removed"] > 0 and readings[-1]["preemptions"] > 0
    # run_end's engine counters are mars_stats() at the close (after the retention is released):
    # the last reading's counters
    end = next(e for e in read_events(out) if e["event"] == "run_end")["engine"]
    counters = ("total_blocks", "block_size", "preemptions", "recomputed_tokens", "kv_blocks_removed")
    assert {k: end[FIELDS[k]] for k in counters} == {k: readings[-1][k] for k in counters}
    assert "policy_state" in end and "retention" in end


def test_telemetry_as_dict_is_the_known_fields_in_order():
    """``Telemetry.as_dict`` (every kv_sample event) reads the fields without dataclasses' deep copy:
    the same dict, key order included, for any mix of known and unknown fields."""
    import dataclasses
    import random

    from vllm_mars.admission.base import Telemetry

    rng = random.Random(0)
    names = [f.name for f in dataclasses.fields(Telemetry)]
    for _ in range(200):
        kw = {n: rng.choice([None, 0, 3, 0.25]) for n in names[1:]}
        t = Telemetry(ts=rng.random(), **kw)
        want = {k: v for k, v in dataclasses.asdict(t).items() if v is not None}
        assert list(t.as_dict().items()) == list(want.items())
