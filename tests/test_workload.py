"""Workload package: schema v1 errors, materialization, the ILR generator, trace converters,
mas_task_v1 tasks and the workload CLI. Pure Python (no vllm import)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
from vllm_mars.cli import main as mars_main
from vllm_mars.workload import ilr, mas_task, tracelab, weka
from vllm_mars.workload.materialize import FIRST_TOKEN_ID, load_plans, materialize_all
from vllm_mars.workload.schema import (
    SCHEMA_V1,
    WorkloadError,
    dump_line,
    load_workload,
    sniff_schema,
    write_workload,
)
from vllm_mars.workload.tooltime import WEKA_TOOL_MIX, fit_tool_mixture, mixture_quantile

ROOT = Path(__file__).resolve().parents[1]
#: real kv-cache-tester traces: the shipped 8-trace sample (whole sessions, no sub-agents) and a
#: test fixture of trimmed ones (sub-agents, contexts past 262k) with the gaps of all 40 public
#: traces (tests/data/weka_trimmed/README.md)
WEKA_SAMPLE = ROOT / "benchmark" / "workloads" / "weka_sample"
WEKA_TRIMMED = ROOT / "tests" / "data" / "weka_trimmed"
WEKA_GAPS = ROOT / "tests" / "data" / "weka_gaps.json"


def wf(wid="a", **kw):
    base = {"schema": SCHEMA_V1, "workflow_id": wid, "prompt_tokens": 10,
            "turns": [{"output_tokens": 4, "tool_s": 0.5, "tool": "bash"}, {"append_tokens": 6, "output_tokens": 3}]}
    base.update(kw)
    return base


def write_lines(tmp_path, lines, name="w.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


# ---------------------------------------------------------------------- schema v1
@pytest.mark.parametrize("bad, field, text", [
    ("{not json", None, "invalid JSON"),
    ("[1, 2]", None, "must be a JSON object"),
    ({"workflow_id": "x", "turns": [{"output_tokens": 1}]}, "schema", "missing"),
    (wf(schema="mars_workload_v9"), "schema", "allowed: 'mars_workload_v1'"),
    ({"schema": "mas_task_v1", "payload": {}}, "schema", "mas_task.load_tasks"),
    (wf(turns=[{"output_tokens": 0}]), "turns[0].output_tokens", "greater than or equal to 1"),
    (wf(turns=[{"output_tokens": 2, "colour": 1}]), "turns[0].colour", "unknown field"),
    (wf(turns=[{"output_tokens": 2, "tool_s": 3}]), "turns[0]", "last turn has no tool"),
    (wf(turns=[{"append_tokens": 5, "output_tokens": 2}]), "turns[0].append_tokens", "must be 0"),
    (wf(turns=[]), "turns", "at least 1"),
    (wf(prompt_tokens=0), "prompt_tokens", "initial prompt is empty"),
    (wf(prefix=[{"key": "s", "tokens": 0}]), "prefix[0].tokens", "greater than or equal to 1"),
    (wf(children=[{"after_turn": 2, "workflow": {"workflow_id": "c", "prompt_tokens": 1,
                                                 "turns": [{"output_tokens": 1}]}}]),
     "children[0].after_turn", "allowed 0..1"),
    (wf(children=[{"after_turn": 0, "workflow": wf("c")}]), "children[0].workflow.schema", "unknown field"),
    (wf(children=[{"after_turn": 0, "workflow": {"workflow_id": "c", "prompt_tokens": 1,
                                                 "turns": [{"output_tokens": "many"}]}}]),
     "children[0].workflow.turns[0].output_tokens", "valid integer"),
])
def test_schema_errors_name_file_line_field(tmp_path, bad, field, text):
    p = write_lines(tmp_path, [wf("ok"), "", bad])
    with pytest.raises(WorkloadError) as ei:
        load_workload(p)
    e = ei.value
    assert (e.path, e.line, e.field) == (str(p), 3, field)
    assert text in str(e) and str(e).startswith(f"{p}:3: ")


def test_schema_duplicate_ids_and_empty_file(tmp_path):
    child = {"after_turn": 0, "workflow": {"workflow_id": "a", "prompt_tokens": 1, "turns": [{"output_tokens": 1}]}}
    with pytest.raises(WorkloadError, match=r"w.jsonl:1: workflow_id: duplicate id 'a'"):
        load_workload(write_lines(tmp_path, [wf("a", children=[child])]))
    with pytest.raises(WorkloadError, match=r":2: workflow_id: duplicate id 'a' \(first on line 1\)"):
        load_workload(write_lines(tmp_path, [wf("a"), wf("a")]))
    with pytest.raises(WorkloadError, match="no workflows"):
        load_workload(write_lines(tmp_path, ["# only a comment"]))
    with pytest.raises(FileNotFoundError):
        load_workload(tmp_path / "missing.jsonl")


def test_schema_roundtrip(tmp_path):
    src = [wf("a", arrival_s=1.5, prefix=[{"key": "sys", "tokens": 8}],
              children=[{"after_turn": 0, "parent_waits": False, "workflow": {
                  "workflow_id": "a.c", "prompt_tokens": 2, "turns": [{"output_tokens": 1}]}}]), wf("b")]
    first = load_workload(write_lines(tmp_path, src))
    p2 = tmp_path / "again.jsonl"
    write_workload(p2, first)
    again = load_workload(p2)
    assert again == first
    assert sniff_schema(p2) == SCHEMA_V1
    assert json.loads(dump_line(again[0]))["schema"] == SCHEMA_V1
    assert again[0].children[0].parent_waits is False
    assert again[0].final_prompt_tokens() == 8 + 10 + 4 + 6


# ---------------------------------------------------------------------- materialization
def test_materialize_ids_shared_prefix_and_determinism(tmp_path):
    sys_seg = [{"key": "sys", "tokens": 64}]
    child = {"after_turn": 0, "workflow": {"workflow_id": "a.c", "prefix": sys_seg, "prompt_tokens": 5,
                                           "turns": [{"output_tokens": 2}]}}
    p = write_lines(tmp_path, [wf("a", prefix=sys_seg, children=[child]), wf("b", prefix=sys_seg)])
    a, b = load_plans(p, vocab_size=100, seed=1)
    assert a.prefill_estimate == len(a.initial_ids) == 74
    assert a.initial_ids[:64] == b.initial_ids[:64]          # shared system prefix: same ids
    assert a.initial_ids[64:] != b.initial_ids[64:]          # task tokens are the workflow's own
    assert [len(t.appended_ids) for t in a.turns] == [0, 6]
    assert a.turns[0].tool_s == 0.5 and a.turns[0].tool_name == "bash" and a.turns[-1].tool_s == 0
    (k, c), = a.children
    assert (k, c.workflow_id, c.root_id, c.parent_id, c.arrival_s) == (0, "a.c", "a", "a", None)
    assert c.initial_ids[:64] == a.initial_ids[:64]
    ids = [i for w in (a, b, c) for i in w.initial_ids + [x for t in w.turns for x in t.appended_ids]]
    assert min(ids) >= FIRST_TOKEN_ID and max(ids) < 100
    assert load_plans(p, vocab_size=100, seed=1) == [a, b]   # deterministic
    assert load_plans(p, vocab_size=100, seed=2)[0].initial_ids != a.initial_ids
    assert a.final_prompt_tokens() == 74 + 4 + 6


# ---------------------------------------------------------------------- ILR generator
ILR_BANDS = {"ILR-1": (2000, 8000), "ILR-2": (8000, 24000), "ILR-3": (24000, 64000), "ILR-4": (64000, 160000)}


@pytest.mark.parametrize("preset", sorted(ILR_BANDS))
def test_ilr_statistics_per_band(preset):
    cfg = ilr.load_preset(preset)
    assert cfg.num_workflows == 400 and cfg.initial_tokens == ILR_BANDS[preset]
    wfs = ilr.generate(cfg)
    assert len(wfs) == 400 and len({w.workflow_id for w in wfs}) == 400
    lo, hi = ILR_BANDS[preset]
    init = [w.initial_tokens for w in wfs]
    assert lo <= min(init) and max(init) <= hi
    # log-uniform: log(initial) is uniform on [log lo, log hi] -> median near the geometric middle,
    # and each quarter of the log band holds about a quarter of the workflows.
    mid = math.sqrt(lo * hi)
    assert abs(math.log(statistics.median(init) / mid)) < 0.1 * math.log(hi / lo)
    span = math.log(hi / lo)
    quarters = [sum(1 for x in init if q / 4 <= math.log(x / lo) / span < (q + 1) / 4) for q in range(4)]
    assert all(60 <= n <= 140 for n in quarters), quarters
    turns = [len(w.turns) for w in wfs]
    assert min(turns) == 4 and max(turns) == 20 and abs(statistics.mean(turns) - 12) < 1
    app = [t.append_tokens for w in wfs for t in w.turns[1:]]
    out = [t.output_tokens for w in wfs for t in w.turns]
    assert 200 <= min(app) and max(app) <= 4000 and abs(statistics.median(app) - math.sqrt(200 * 4000)) < 150
    assert 50 <= min(out) and max(out) <= 800 and abs(statistics.median(out) - 200) < 25
    tools = [t.tool_s for w in wfs for t in w.turns[:-1]]
    assert all(t.tool_s == 0 and t.tool is None for w in wfs for t in w.turns[-1:])
    assert 6.0 < statistics.median(tools) < 11.0 and max(tools) <= 300.0  # weka median gap ~8.6 s
    assert {t.tool for w in wfs for t in w.turns[:-1]} <= {s.name for s in WEKA_TOOL_MIX}
    sys_keys = {s.key for w in wfs for s in w.prefix}
    assert len(sys_keys) == cfg.num_system_prompts                       # shared system prompts


def test_ilr_seed_reproducibility_scale_and_prefix_stability():
    cfg = ilr.load_preset("ILR-2", num_workflows=40, seed=7)
    a, b = ilr.generate(cfg), ilr.generate(cfg)
    assert [dump_line(w) for w in a] == [dump_line(w) for w in b]
    other = ilr.generate(ilr.load_preset("ILR-2", num_workflows=40, seed=8))
    assert [dump_line(w) for w in a] != [dump_line(w) for w in other]
    # the first N workflows do not depend on num_workflows
    short = ilr.generate(ilr.load_preset("ILR-2", num_workflows=10, seed=7))
    assert [dump_line(w) for w in short] == [dump_line(w) for w in a[:10]]
    # scale divides token counts, keeps structure and tool times
    scaled = ilr.generate(ilr.load_preset("ILR-2", num_workflows=40, seed=7, scale=32))
    for x, y in zip(a, scaled):
        assert len(x.turns) == len(y.turns)
        assert [t.tool_s for t in x.turns] == [t.tool_s for t in y.turns]
        assert abs(y.initial_tokens - x.initial_tokens / 32) <= 2
        assert all(abs(ty.output_tokens - max(1, tx.output_tokens / 32)) <= 1 for tx, ty in zip(x.turns, y.turns))


def test_ilr_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown workload preset 'ILR-7'; available: .*ilr1"):
        ilr.load_preset("ILR-7")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nturns = [5, 2]\n')
    with pytest.raises(ValueError, match=r"bad.toml: IlrConfig.turns must be \[low, high\]"):
        ilr.load_preset(bad)
    bad.write_text('name = "x"\nturnz = [5, 2]\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['turnz'\]; valid keys: name, num_workflows"):
        ilr.load_preset(bad)


def test_bundled_compact_default_matches_its_preset():
    path = ROOT / "benchmark" / "workloads" / "compact.jsonl"
    roots = load_workload(path)
    assert [dump_line(w) for w in roots] == [dump_line(w) for w in ilr.generate(ilr.load_preset("compact"))]
    allw = [w for r in roots for w in r.walk()]
    assert 24 <= len(roots) <= 32 and len(allw) > len(roots)          # a few children
    assert all(3 <= len(r.turns) <= 6 for r in roots)
    assert all(150 <= w.initial_tokens <= 700 for w in allw)
    assert len({r.prefix[0].key for r in roots}) < len(roots)          # shared system prefix
    tools = [t.tool_s for w in allw for t in w.turns[:-1]]
    assert min(tools) >= 0.05 and max(tools) <= 1.5
    plans = load_plans(path)
    j = next(i for i, r in enumerate(roots) if i and r.prefix[0].key == roots[0].prefix[0].key)
    n = roots[0].prefix[0].tokens
    assert plans[0].initial_ids[:n] == plans[j].initial_ids[:n]


# ---------------------------------------------------------------------- tool-time mixture
def test_tool_mixture_refits_from_weka_traces():
    per_trace = json.loads(WEKA_GAPS.read_text())["gaps"]
    assert len(per_trace) == 40
    # the recorded gaps are what iter_gaps reads from the traces (the whole ones shipped here)
    for f in weka.trace_files(WEKA_SAMPLE):
        assert list(weka.iter_gaps(f)) == per_trace[f.stem], f.name
    gaps = [g for gs in per_trace.values() for g in gs]
    assert len(gaps) > 1000
    fit = {t.name: t for t in fit_tool_mixture(gaps, iters=30)}
    for t in WEKA_TOOL_MIX:
        assert abs(fit[t.name].weight - t.weight) < 0.05, (t, fit[t.name])
        assert abs(fit[t.name].sigma - t.sigma) < 0.1 or t.weight < 0.03
    data_med = statistics.median(gaps)
    assert abs(mixture_quantile(WEKA_TOOL_MIX, 0.5) - data_med) / data_med < 0.15


# ---------------------------------------------------------------------- weka converter
def _raw_calls(reqs):
    return sorted((r for r in reqs if r["type"] != "subagent"), key=lambda r: r["t"])


def test_weka_converter_turns_tokens_children():
    files = weka.trace_files(WEKA_SAMPLE) + weka.trace_files(WEKA_TRIMMED)
    assert len(files) == 11
    roots = weka.convert_dir(WEKA_SAMPLE) + weka.convert_dir(WEKA_TRIMMED)
    total_children = 0
    for f, root in zip(files, roots):
        raw = json.loads(f.read_text())
        assert root.workflow_id == raw["id"]
        calls = _raw_calls(raw["requests"])
        assert len(root.turns) == len(calls)
        assert sum(t.output_tokens for t in root.turns) == sum(c["out"] for c in calls)
        assert root.initial_tokens == calls[0]["in"]
        subs = [r for r in raw["requests"] if r["type"] == "subagent"]
        assert len(root.children) == len(subs)
        total_children += len(subs)
        for s, ch in zip(sorted(subs, key=lambda r: r["t"]), root.children):
            assert ch.workflow.workflow_id == f"{raw['id']}/{s['agent_id']}"
            assert len(ch.workflow.turns) == len(_raw_calls(s["requests"]))
            assert calls[ch.after_turn]["t"] <= s["t"]
        # turn k's prompt = turn k-1's + output + append; it equals the trace's `in` until the
        # recorded context first shrinks (thinking dropped, compaction): append-only from there
        n = root.initial_tokens
        for k in range(1, len(calls)):
            n += root.turns[k - 1].output_tokens + root.turns[k].append_tokens
            if calls[k]["in"] < calls[k - 1]["in"] + calls[k - 1]["out"]:
                break
            assert n == calls[k]["in"], (f.name, k)
        assert all(0 <= t.tool_s <= weka.DEFAULT_MAX_TOOL_S for t in root.turns)
    assert total_children == 4


def test_weka_hash_blocks_are_shared_token_ids(tmp_path):
    out = tmp_path / "wk.jsonl"
    assert mars_main(["convert", "weka", str(WEKA_TRIMMED / "trace_0010.json"), "-o", str(out), "--scale", "8"]) == 0
    (root,) = load_plans(out, seed=3)
    raw = json.loads((WEKA_TRIMMED / "trace_0010.json").read_text())
    kids = [c for _, c in root.children]
    assert len(kids) == 4 and all(c.root_id == "trace_0010" and c.parent_id == "trace_0010" for c in kids)
    # the Explore sub-agents' first requests share leading hash blocks -> identical leading ids
    subs = sorted((r for r in raw["requests"] if r["type"] == "subagent"), key=lambda r: r["t"])
    h0, h1 = subs[0]["requests"][0]["hash_ids"], subs[1]["requests"][0]["hash_ids"]
    common = next(i for i, (x, y) in enumerate(zip(h0, h1)) if x != y)
    assert common >= 5
    bt = 64 // 8
    assert kids[0].initial_ids[:common * bt] == kids[1].initial_ids[:common * bt]
    assert kids[0].initial_ids[common * bt:(common + 1) * bt] != kids[1].initial_ids[common * bt:(common + 1) * bt]
    assert root.initial_ids[:bt] != kids[0].initial_ids[:bt]
    # scale divides token counts (rounding per block / per turn)
    calls = _raw_calls(raw["requests"])
    assert abs(root.prefill_estimate - calls[0]["in"] / 8) <= 1
    assert abs(root.total_output_tokens - sum(c["out"] for c in calls) / 8) <= len(calls)


# ---------------------------------------------------------------------- TraceLab CSV
CSV = """session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms
s1,10.0,0,1000,200,50,300
s2,12.5,0,1000,300,60,100
s1,10.0,1,1250,100,40,250
s1,10.0,2,1390,80,30,0
s2,12.5,1,1360,40,20,0
"""


def test_tracelab_converter(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(CSV)
    s1, s2 = tracelab.convert_csv(p)
    assert (s1.workflow_id, s1.arrival_s, s2.arrival_s) == ("tracelab-s1", 0.0, 2.5)
    assert s1.prefix[0].key == s2.prefix[0].key == "tracelab:prefix" and s1.prefix[0].tokens == 1000
    assert [(t.append_tokens, t.output_tokens, t.tool_s) for t in s1.turns] == [(0, 50, 0.3), (100, 40, 0.25), (80, 30, 0.0)]
    assert s1.final_prompt_tokens() == 1390 + 80
    assert [t.append_tokens for t in s2.turns] == [0, 40]
    half = tracelab.convert_csv(p, scale=2, shared_first_prefix=False)
    assert half[0].prefix[0].key is None and half[0].initial_tokens == 600
    out = tmp_path / "t.jsonl"
    assert mars_main(["convert", "tracelab", str(p), "-o", str(out)]) == 0
    assert [w.workflow_id for w in load_workload(out)] == ["tracelab-s1", "tracelab-s2"]


@pytest.mark.parametrize("edit, line, col", [
    (lambda s: s.replace("tool_wait_after_ms", "wait"), 1, "tool_wait_after_ms"),
    (lambda s: s.replace("s1,10.0,1,1250,100,40", "s1,10.0,1,1250,lots,40"), 4, "input_len"),
    (lambda s: s.replace("s2,12.5,1,1360", "s2,12.5,0,1360"), 6, "round_idx"),
    (lambda s: s.replace("s1,10.0,2,1390,80,30", "s1,10.0,2,1390,80,0"), 5, "output_len"),
])
def test_tracelab_errors_name_line_and_column(tmp_path, edit, line, col):
    p = tmp_path / "t.csv"
    p.write_text(edit(CSV))
    with pytest.raises(WorkloadError) as ei:
        tracelab.convert_csv(p)
    assert (ei.value.line, ei.value.field) == (line, col), str(ei.value)


# ---------------------------------------------------------------------- mas_task_v1
GOOD_TASK = {"schema": "mas_task_v1", "request_id": "tb:broken-python", "task_id": "broken-python",
             "benchmark": "terminalbench", "prefill_tokens": 1830,
             "payload": {"instruction": "Fix pip.", "hint": ""},
             "workspace_init": [{"path": "problem_statement.txt", "content": "Fix pip."}]}


def test_mas_task_loader(tmp_path):
    p = write_lines(tmp_path, [GOOD_TASK, "", {"schema": "mas_task_v1", "payload": {}}], "t.jsonl")
    assert sniff_schema(p) == "mas_task_v1"
    a, b = mas_task.load_tasks(p)
    assert (a.workflow_id, a.line, a.prefill_tokens, a.benchmark) == ("tb:broken-python", 1, 1830, "terminalbench")
    assert a.workspace_init[0].path == "problem_statement.txt" and "Fix pip." in a.user_prompt()
    assert (b.workflow_id, b.benchmark, b.task_text()) == ("task-3", "generic", "{}")


@pytest.mark.parametrize("bad, field, text", [
    ("[]", None, "must be a JSON object"),
    ({"schema": "mas_task_v2", "payload": {}}, "schema", "expected 'mas_task_v1'"),
    ({"schema": "mas_task_v1"}, "payload", "missing"),
    ({"schema": "mas_task_v1", "payload": []}, "payload", "must be an object"),
    ({**GOOD_TASK, "prefill_tokens": 0}, "prefill_tokens", "positive integer"),
    ({**GOOD_TASK, "workspace_init": [{"path": "../escape.txt", "content": ""}]}, "workspace_init[0].path", "inside"),
    ({**GOOD_TASK, "workspace_init": [{"path": "/etc/passwd", "content": ""}]}, "workspace_init[0].path", "relative"),
])
def test_mas_task_errors(tmp_path, bad, field, text):
    p = write_lines(tmp_path, [{"schema": "mas_task_v1", "payload": {}, "request_id": "x"}, bad], "t.jsonl")
    with pytest.raises(WorkloadError) as ei:
        mas_task.load_tasks(p)
    assert (ei.value.line, ei.value.field) == (2, field) and text in str(ei.value)
    assert str(ei.value).startswith(f"{p}:2:")
    with pytest.raises(WorkloadError, match="no tasks"):
        mas_task.load_tasks(write_lines(tmp_path, [""], "empty.jsonl"))


def test_parse_action_never_raises():
    ok = mas_task.parse_action('thinking... ```json\n{"action": "tool", "tool": "run_cmd", "cmds": ["ls {x}"]}\n```')
    assert isinstance(ok, mas_task.Action) and ok.tool == "run_cmd" and ok.args == {"cmds": ["ls {x}"]}
    assert mas_task.parse_action('{"action": "final"}').kind == "final"
    for junk in ["", "tok tok tok", "{{{", '{"action": "tool", "tool": "rm_rf"}', '{"action": "dance"}',
                 "\x00\ufffd{'a': 1}"]:
        assert isinstance(mas_task.parse_action(junk), mas_task.ParseFailure), junk


# ---------------------------------------------------------------------- CLI
def test_cli_gen_workload_and_stats(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert mars_main(["gen-workload", "--preset", "ILR-3", "--num-workflows", "6", "--scale", "64",
                      "--seed", "5", "-o", str(out)]) == 0
    roots = load_workload(out)
    assert len(roots) == 6 and all(24000 / 64 - 1 <= w.initial_tokens <= 64000 / 64 + 1 for w in roots)
    assert roots[0].meta == {"preset": "ILR-3", "seed": 5, "scale": 64.0, "index": 0}
    assert mars_main(["workload-stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert stats["workflows"] == 6 and stats["calls"] == sum(len(w.turns) for w in roots)
    assert mars_main(["gen-workload", "--preset", "nope", "-o", str(out)]) == 2
    assert "unknown workload preset 'nope'" in capsys.readouterr().err


def test_workload_package_imports_no_vllm():
    import subprocess
    code = ("import sys, vllm_mars.workload, vllm_mars.workload.ilr, vllm_mars.workload.weka, "
            "vllm_mars.workload.tracelab, vllm_mars.workload.mas_task, vllm_mars.commands.workload; "
            "print(any(m.split('.')[0] in ('vllm', 'torch') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_materialize_all_matches_generator_sizes():
    roots = ilr.generate(ilr.load_preset("ILR-1", num_workflows=5, scale=16))
    plans = materialize_all(roots, vocab_size=4096, seed=0)
    for w, p in zip(roots, plans):
        assert p.prefill_estimate == w.initial_tokens and p.final_prompt_tokens() == w.final_prompt_tokens()
        assert [len(t.appended_ids) for t in p.turns] == [t.append_tokens for t in w.turns]


def test_weka_converter_errors_and_tool_cmd_passthrough(tmp_path):
    bad = tmp_path / "trace_bad.json"
    bad.write_text(json.dumps({"id": "tb", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 70, "out": 5, "hash_ids": [1], "api_time": 1.0},
        {"t": 3.0, "type": "n", "in": 90, "hash_ids": [1], "api_time": 1.0}]}))
    with pytest.raises(WorkloadError, match=r"trace_bad.json: requests\[1\].out: missing"):
        weka.convert_trace(bad)
    bad.write_text("{")
    with pytest.raises(WorkloadError, match="invalid JSON"):
        weka.convert_trace(bad)
    ok = tmp_path / "trace_ok.json"
    ok.write_text(json.dumps({"id": "tok", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 70, "out": 5, "hash_ids": [1], "api_time": 1.0},
        {"t": 3.5, "type": "n", "in": 90, "out": 7, "hash_ids": [1], "api_time": 1.0}]}))
    (w,) = weka.convert_dir(ok)
    assert (w.prefix[0].key, w.prompt_tokens, w.turns[0].tool_s, w.turns[1].append_tokens) == ("tok:1", 6, 2.5, 15)
    p = write_lines(tmp_path, [wf("a", turns=[{"output_tokens": 2, "tool_s": 1, "tool": "bash",
                                               "tool_cmd": "echo hi"}, {"append_tokens": 1, "output_tokens": 1}])])
    (plan,) = load_plans(p)
    assert (plan.turns[0].tool_cmd, plan.turns[0].tool_name, plan.turns[1].tool_cmd) == ("echo hi", "bash", None)
