"""Metrics on plain data: percentiles, summaries from hand-built event logs, T_ideal, the compare table."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from vllm_mars.metrics.compare import cell_speedup, compare_record, format_table
from vllm_mars.metrics.events import EventLog, read_events, read_jsonl
from vllm_mars.metrics.ideal import CostModel, ideal_time
from vllm_mars.metrics.summary import percentile, summarize


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(list(reversed(xs)), 90) == pytest.approx(3.7)


def _log(tmp_path):
    """Two roots: w0 (arrives 0, done 4, ideal 1.5), w1 (arrives 1, done 10, ideal 2) and a failed w2."""
    t = {"now": 0.0}
    log = EventLog(tmp_path / "events.jsonl", lambda: t["now"])
    log.emit("run_start", policy="fcfs", controller="none", t_ideal_source="test")
    log.emit("kv_sample", ts=0.0, kv_usage=0.0, retained_blocks=0, num_blocks=10, preemptions=2,
             recomputed_tokens=100)
    log.emit("workflow_arrive", ts=0.0, workflow="w0", t_ideal_s=1.5)
    log.emit("workflow_arrive", ts=1.0, workflow="w1", t_ideal_s=2.0)
    log.emit("workflow_arrive", ts=1.0, workflow="w2", t_ideal_s=2.0)
    log.emit("call_end", ts=0.5, workflow="w0", turn=0, prompt_tokens=100, cached_tokens=0, output_tokens=10,
             ttft_s=0.1, latency_s=0.5)
    log.emit("call_end", ts=3.0, workflow="w0", turn=1, prompt_tokens=200, cached_tokens=100, output_tokens=10,
             ttft_s=0.3, latency_s=0.4)
    log.emit("kv_sample", ts=2.0, kv_usage=0.5, retained_blocks=4, num_blocks=10, preemptions=3,
             recomputed_tokens=150)
    log.emit("workflow_done", ts=4.0, workflow="w0", root_done=True)
    log.emit("call_end", ts=9.0, workflow="w1", turn=0, prompt_tokens=100, cached_tokens=50, output_tokens=5,
             ttft_s=0.2, latency_s=1.0)
    log.emit("kv_sample", ts=6.0, kv_usage=1.0, retained_blocks=0, num_blocks=10, preemptions=7,
             recomputed_tokens=400)
    log.emit("workflow_error", ts=5.0, workflow="w2", root_done=True, error="boom")
    log.emit("admission_window", ts=1.0, new=4)
    log.emit("admission_window", ts=2.0, new=2)
    log.emit("workflow_done", ts=10.0, workflow="w1", root_done=True)
    log.close()
    return read_events(tmp_path)


def test_summary_recomputes_every_field_from_events(tmp_path):
    s = summarize(_log(tmp_path))
    assert (s["workflows"], s["completed"], s["errors"]) == (3, 2, 1)
    assert s["completion_rate"] == pytest.approx(2 / 3)
    assert s["makespan_s"] == pytest.approx(10.0)
    assert s["e2e_s"]["mean"] == pytest.approx((4.0 + 9.0) / 2)
    assert s["e2e_s"]["p50"] == pytest.approx(6.5)
    # w0: 4 <= 3 * 1.5 (alpha 3 and 5, not 1.5 or 2); w1: 9 > 5 * 2 is false -> within alpha 5
    assert s["goodput_within"] == {"1.5": 0, "2.0": 0, "3.0": 1, "5.0": 2}
    assert s["goodput_wps"]["3.0"] == pytest.approx(0.1)
    assert s["ttft_by_round"]["0"]["n"] == 2
    assert s["ttft_by_round"]["0"]["mean"] == pytest.approx(0.15)
    assert s["ttft_by_round"]["1"]["p50"] == pytest.approx(0.3)
    assert s["prefix_hit_rate"] == pytest.approx(150 / 400)
    assert s["calls"]["output_tokens"] == 25
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(2.5)
    assert s["preemptions"] == 5 and s["recomputed_tokens"] == 300
    # retained blocks: 0 for [0,2), 4 for [2,6)
    assert s["retained_block_seconds"] == pytest.approx(16.0)
    # time-weighted KV usage: 0 x 2 s + 0.5 x 4 s over 6 s
    assert s["kv_usage"]["mean"] == pytest.approx(2.0 / 6.0)
    assert s["kv_usage"]["max"] == 1.0
    assert (s["admission"]["window_min"], s["admission"]["window_max"]) == (2, 4)
    assert s["t_ideal_source"] == "test"


def test_event_log_is_jsonl_and_bad_lines_name_file_and_line(tmp_path):
    _log(tmp_path)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert all(json.loads(x)["event"] for x in lines)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ts": 0, "event": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(read_jsonl(bad))
    with pytest.raises(FileNotFoundError, match="no events.jsonl"):
        read_events(tmp_path / "nowhere")


@dataclass
class _Turn:
    appended_ids: list
    output_tokens: int
    tool_s: float


@dataclass
class _Plan:
    initial_ids: list
    turns: list
    children: list = field(default_factory=list)
    parent_waits: bool = True


def test_cost_model_fit_and_critical_path():
    cost = CostModel.from_solo_calls((100, 0.02), (500, 0.06), (11, 0.16))
    assert cost.prefill_s_per_token == pytest.approx(1e-4)
    assert cost.call_overhead_s == pytest.approx(0.01)
    assert cost.decode_s == pytest.approx(0.01)
    assert cost.calibrated
    with pytest.raises(ValueError):
        CostModel.from_solo_calls((500, 0.1), (100, 0.2), (11, 0.3))
    c = CostModel(prefill_s_per_token=0.001, decode_s=0.01, source="test")
    # turn 0: 100 new tokens + 4 decode steps = 0.14; tool 1 s; turn 1: 9 + 1 new tokens + 0 decode = 0.01
    plan = _Plan([0] * 100, [_Turn([], 5, 1.0), _Turn([0] * 9, 1, 0.0)])
    assert ideal_time(plan, c) == pytest.approx(0.14 + 1.0 + 0.01)
    # a waiting child started after turn 0 that takes 3 s delays turn 1
    child = _Plan([0] * 1000, [_Turn([], 1, 2.0), _Turn([0] * 999, 1, 0.0)])
    assert ideal_time(child, c) == pytest.approx(1.0 + 2.0 + 1.0)
    plan.children = [(0, child)]
    assert ideal_time(plan, c) == pytest.approx(0.14 + 4.0 + 0.01)
    # a non-waiting child only extends the end
    child.parent_waits = False
    assert ideal_time(plan, c) == pytest.approx(0.14 + 4.0)


def _summary(mean, good=None, pre=0):
    return {"e2e_s": {"mean": mean, "p95": mean * 2}, "goodput_wps": {"3.0": good}, "goodput_within": {"3.0": 1},
            "completed": 2, "workflows": 2, "preemptions": pre, "recomputed_tokens": pre * 10}


def test_speedup_is_over_the_fastest_baseline_and_table_has_the_paper_shape():
    cells = {2.0: {"mars": _summary(4.0, 0.5), "fcfs": _summary(10.0, 0.1, 3), "autellix": _summary(8.0, 0.2),
                   "mars-no-admission": _summary(3.0, 0.6)}}
    sp = cell_speedup(cells[2.0])
    assert sp["baseline"] == "autellix" and sp["speedup"] == pytest.approx(2.0)
    assert cell_speedup({"fcfs": _summary(1.0)})["speedup"] is None
    rec = compare_record("benchmark/workloads/compact.jsonl", cells)
    table = format_table(rec)
    first_row = table.splitlines()[2]
    assert "compact" in first_row and "2.00x vs autellix" in first_row
    assert "goodput@3.0 mars" in table.splitlines()[0]
    assert rec["cells"][0]["policies"]["fcfs"]["preemptions"] == 3
