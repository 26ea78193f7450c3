"""Schema v2's context compaction (schema, token plans, the driver on the sim) and the weka
converter's compaction, memory bound and id rules. The sim runs end with the engine's leak check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_mars.cli import main as mars_main
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.metrics.events import read_events
from vllm_mars.workload import weka
from vllm_mars.workload.materialize import check_context, load_plans
from vllm_mars.workload.schema import SCHEMA_V1, SCHEMA_V2, WorkloadError, dump_line, load_workload

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "benchmark" / "workloads" / "weka_sample"
TRIMMED = REPO / "tests" / "data" / "weka_trimmed"  # real traces, trimmed (README.md there)


def _v2(wid="c", compact=None, schema=SCHEMA_V2, **kw):
    turns = [{"output_tokens": 20, "tool_s": 0.5, "tool": "bash"},
             {"append_tokens": 30, "output_tokens": 10, "tool_s": 0.5},
             {"append_tokens": 16, "output_tokens": 8, **({"compact": compact} if compact else {})}]
    return {"schema": schema, "workflow_id": wid, "prefix": [{"key": "sys", "tokens": 64}], "prompt_tokens": 200,
            "turns": turns, **kw}


def _write(path: Path, *lines) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# -- schema -------------------------------------------------------------------------------------------
def test_v2_compaction_prompt_lengths_and_version_rules(tmp_path):
    (w,) = load_workload(_write(tmp_path / "a.jsonl", _v2(compact={"keep_tokens": 64, "summary_tokens": 40})))
    # turn 1: 264 + 20 + 30 = 314; turn 2 restarts: 64 kept + 40 summary + 16 new
    assert w.prompt_lengths() == [264, 314, 120]
    assert w.final_prompt_tokens() == 120 and w.peak_context_tokens() == 324
    assert json.loads(dump_line(w))["schema"] == SCHEMA_V2
    # v1 files still read, and a workflow without compaction is written as v1
    (old,) = load_workload(_write(tmp_path / "b.jsonl", _v2(schema=SCHEMA_V1)))
    assert json.loads(dump_line(old))["schema"] == SCHEMA_V1 and old.prompt_lengths() == [264, 314, 340]


@pytest.mark.parametrize("line, where", [
    (_v2(schema=SCHEMA_V1, compact={"summary_tokens": 5}), "b.jsonl:2: turns[2].compact: needs schema 'mars_workload_v2'"),
    (_v2(compact={"keep_tokens": 325, "summary_tokens": 5}), "b.jsonl:2: turns[2].compact.keep_tokens: 325 but the "
                                                              "context before turn 2 has 324 tokens (allowed 0..324)"),
    (_v2(compact={"keep_tokens": 1}), "b.jsonl:2: turns[2].compact.summary_tokens: Field required"),
    (_v2(compact={"keep_tokens": -1, "summary_tokens": 1}), "b.jsonl:2: turns[2].compact.keep_tokens: Input should be"),
    ({**_v2(), "turns": [{"output_tokens": 3, "compact": {"summary_tokens": 2}}]},
     "b.jsonl:2: turns[0].compact: turn 0 cannot compact"),
    ({**_v2(), "schema": "mars_workload_v3"}, "b.jsonl:2: schema: unsupported schema 'mars_workload_v3'; allowed: "
                                              "'mars_workload_v1', 'mars_workload_v2'"),
])
def test_v2_errors_name_file_line_field(tmp_path, line, where):
    p = _write(tmp_path / "b.jsonl", _v2("ok"), line)
    with pytest.raises(WorkloadError) as e:
        load_workload(p)
    assert str(e.value).startswith(str(tmp_path / where)), str(e.value)


def test_materialized_compaction_keeps_the_head_and_draws_a_unique_summary(tmp_path):
    lines = [_v2("a", compact={"keep_tokens": 64, "summary_tokens": 40}),
             _v2("b", compact={"keep_tokens": 64, "summary_tokens": 40})]
    a, b = load_plans(_write(tmp_path / "w.jsonl", *lines), seed=1)
    t = a.turns[2]
    context = list(range(a.prompt_lengths()[1] + a.turns[1].output_tokens))
    assert t.next_prompt(context) == context[:64] + t.summary_ids + t.appended_ids
    assert len(t.summary_ids) == 40 and t.summary_ids != b.turns[2].summary_ids
    assert a.initial_ids[:64] == b.initial_ids[:64]
    assert a.prompt_lengths() == [264, 314, 120] and a.peak_context_tokens() == 324
    with pytest.raises(ValueError, match="reaches 324 tokens of context, above max_model_len=323"):
        check_context("w.jsonl", load_workload(tmp_path / "w.jsonl"), 323)


# -- the driver on the sim ------------------------------------------------------------------------------
def _sim(tmp_path: Path, wl: Path, name: str) -> tuple[dict, list[dict]]:
    out, _ = run_replay(ReplayConfig(workload=str(wl), policy="mars", rps=1.0, backend="sim", profile="cpu-tiny",
                                     progress=False, out=str(tmp_path / name)))
    summary = json.loads((out / "summary.json").read_text())
    events = read_events(out)
    end = [e for e in events if e["event"] == "run_end"][-1]["engine"]
    assert end["leak_check"] == "ok" and end["free_blocks"] == end["num_blocks"] and end["retained_blocks"] == 0
    return summary, events


def test_a_compacted_turn_replays_with_the_summary_missing_the_prefix_cache(tmp_path):
    keep = 64  # the shared system prompt (4 blocks of 16)
    wl = _write(tmp_path / "w.jsonl", _v2("a", compact={"keep_tokens": keep, "summary_tokens": 40}),
                _v2("plain"))
    summary, events = _sim(tmp_path, wl, "r")
    assert summary["completed"] == 2 and summary["errors"] == 0
    ends = {(e["workflow"], e["turn"]): e for e in events if e["event"] == "call_end"}
    assert ends[("a", 2)]["prompt_tokens"] == 120 and ends[("plain", 2)]["prompt_tokens"] == 340
    # the compacted call hits only its kept head; an uncompacted one hits its whole earlier context
    assert 0 < ends[("a", 2)]["cached_tokens"] <= keep
    assert ends[("plain", 2)]["cached_tokens"] >= 314


def test_weka_prompts_follow_the_trace_through_its_compactions(tmp_path):
    roots = weka.convert_dir(SAMPLE)
    assert sum(w.meta["compactions"] for r in roots for w in r.walk()) == 11
    for f, root in zip(weka.trace_files(SAMPLE), roots, strict=True):
        calls = weka._calls(json.loads(f.read_text())["requests"])
        assert root.prompt_lengths() == [c["in"] for c in calls], f.name  # every call, not just up to a shrink
        for t, (p, c) in zip(root.turns[1:], zip(calls, calls[1:])):
            assert (t.compact is not None) == (c["in"] < p["in"] + p["out"])
            if t.compact is not None:  # keeps exactly the blocks its hash ids share with the previous call
                shared = weka._lcp(p["hash_ids"], c["hash_ids"])
                assert t.compact.keep_tokens == min(64 * shared, c["in"])


def test_a_compacted_weka_trace_replays_in_the_sim(tmp_path, capsys):
    wl = tmp_path / "wk.jsonl"
    src = str(SAMPLE / "trace_0086.json")
    # trace_0086 peaks at 37,448 tokens; at scale 32 a 700-token window forces compactions (the
    # shipped cpu-tiny profile: 32-token blocks, 96 of them)
    assert mars_main(["convert", "weka", src, "-o", str(wl), "--scale", "32", "--max-context", "700"]) == 0
    assert "compactions" in capsys.readouterr().out
    (root,) = load_workload(wl)
    assert root.meta["forced_compactions"] >= 2 and root.meta["compactions"] >= 1
    assert root.peak_context_tokens() <= 700 and json.loads(wl.read_text())["schema"] == SCHEMA_V2
    summary, events = _sim(tmp_path, wl, "r")
    assert summary["completed"] == 1 and summary["errors"] == 0
    ends = [e for e in events if e["event"] == "call_end"]
    assert len(ends) == len(root.turns) and max(e["prompt_tokens"] for e in ends) <= 700
    # without --max-context the same trace does not fit the run's window
    with pytest.raises(ValueError, match="above max_model_len=700"):
        check_context("x", weka.convert_dir(src, scale=32), 700)


def test_unscaled_weka_traces_fit_a_262k_model_with_compaction():
    with pytest.raises(ValueError, match="above max_model_len=262144"):
        check_context("x", weka.convert_dir(TRIMMED), 262144)
    roots = {r.workflow_id: r for r in weka.convert_dir(TRIMMED, max_context=262144)
             + weka.convert_dir(SAMPLE, max_context=262144)}
    check_context("x", list(roots.values()), 262144)
    # trace_0038 grows from 31.8k to 448.8k tokens: compacts first; trace_0056 starts at 300.8k
    assert roots["trace_0038"].meta["forced_compactions"] >= 1
    assert roots["trace_0056"].meta["truncated_inputs"] == 1
    assert roots["trace_0056"].peak_context_tokens() <= 262144
    # the whole sample fits as it is: nothing forced there
    assert all(w.meta["forced_compactions"] == 0 and w.meta["truncated_inputs"] == 0
               for r in weka.convert_dir(SAMPLE, max_context=262144) for w in r.walk())


# -- issue 35 hole 14: the weka converter's memory, ids and numbers --------------------------------------
def test_weka_convert_memory_is_bounded_for_millions_of_hash_ids(tmp_path):
    n = 2_000_000
    trace = tmp_path / "trace_big.json"
    with trace.open("w") as f:
        f.write('{"id": "big", "block_size": 64, "requests": [{"t": 0, "type": "n", "in": %d, "out": 5, '
                '"api_time": 1, "hash_ids": [' % (64 * n + 10))
        f.write(",".join(str(1_000_000 + i) for i in range(n)))
        f.write(']}, {"t": 3, "type": "n", "in": 100, "out": 4, "hash_ids": [1]}]}')  # then a compaction
    assert trace.stat().st_size > 15 << 20
    # the converting process's peak RSS (VmHWM: ru_maxrss would include pytest's, kept across exec)
    # above its peak once mars' CLI is imported and its parser built (what every command costs)
    code = ("import re,sys;from vllm_mars.cli import build_parser,main\n"
            "def hwm(): return int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
            "build_parser();base=hwm();rc=main(sys.argv[1:]);print(base, hwm());sys.exit(rc)")
    out = tmp_path / "big.jsonl"
    r = subprocess.run([sys.executable, "-c", code, "convert", "weka", str(trace), "-o", str(out), "--scale", "64"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    base, peak = (int(x) for x in r.stdout.split()[-2:])
    rss_mb = (peak - base) / 1024
    assert rss_mb < 300, f"{rss_mb:.0f} MB more to convert a {trace.stat().st_size >> 20} MB trace"
    (w,) = load_workload(out)
    assert w.initial_tokens == n + 10 // 64 and len(w.prefix) == 1  # 2M blocks are one segment
    assert w.turns[1].compact is not None and w.turns[1].compact.keep_tokens == 0  # no block shared
    assert w.prompt_lengths() == [n + 10 // 64, round(100 / 64)]


def test_weka_duplicate_agent_ids_get_unique_workflow_ids(tmp_path, capsys):
    def sub(t):
        return {"t": t, "type": "subagent", "agent_id": "a1", "duration_ms": 500,
                "requests": [{"t": t, "type": "n", "in": 80, "out": 3, "hash_ids": [7]}]}
    trace = tmp_path / "trace_dup.json"
    trace.write_text(json.dumps({"id": "dup", "requests": [
        {"t": 0, "type": "n", "in": 70, "out": 5, "hash_ids": [1], "api_time": 1}, sub(1.0), sub(2.0),
        {"t": 5, "type": "n", "in": 90, "out": 4, "hash_ids": [1]}]}))
    out = tmp_path / "o.jsonl"
    assert mars_main(["convert", "weka", str(trace), "-o", str(out)]) == 0
    assert mars_main(["workload-stats", str(out)]) == 0  # the output validates
    (w,) = load_workload(out)
    assert [c.workflow.workflow_id for c in w.children] == ["dup/a1", "dup/a1#2"]
    assert [c.workflow.meta["agent_id"] for c in w.children] == ["a1", "a1"]
    # two trace files with one id are refused at convert, naming the file
    (tmp_path / "trace_dup2.json").write_text(trace.read_text())
    with pytest.raises(WorkloadError, match=r"trace_dup2.json: id: trace id 'dup' is also the id of"):
        weka.convert_dir(tmp_path)


def test_weka_huge_integer_error_names_file_and_line(tmp_path, capsys):
    trace = tmp_path / "trace_int.json"
    trace.write_text('{"id": "x",\n "requests": [{"t": 0, "type": "n",\n "in": ' + "9" * 5000 + ', "out": 1}]}')
    assert mars_main(["convert", "weka", str(trace), "-o", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:3: invalid JSON: an integer of 5000 digits at column 8" in err
    # the same in a workload line
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps(_v2("ok")) + "\n" + '{"schema": "mars_workload_v2", "arrival_s": ' + "1" * 5000 + "}\n")
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: invalid JSON: an integer of 5000 digits"):
        load_workload(wl)
