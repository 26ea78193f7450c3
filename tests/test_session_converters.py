"""`mars convert codex|opencode|openhands`: the frontends' own session logs as workloads.

The logs in tests/data/sessions/ were written by the real CLIs (Codex 0.171.0, OpenCode 1.18.33,
OpenHands SDK 1.58.2) against a scripted endpoint (tests/data/sessions/capture_sessions.py, its
README says how); the live test below re-captures Codex and OpenCode with the installed CLIs. The
sim replays end with the engine's leak check."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sqlite3
from datetime import datetime
from pathlib import Path

import pytest
from vllm_mars.cli import main as mars_main
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.metrics.events import read_events
from vllm_mars.workload import sessions
from vllm_mars.workload.schema import WorkloadError, load_workload

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "sessions"
AGENTS_BIN = REPO / ".agents" / "node_modules" / ".bin"


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def _convert(tmp_path: Path, frontend: str, src: Path, *extra: str) -> list:
    out = tmp_path / f"{frontend}.jsonl"
    assert mars_main(["convert", frontend, str(src), "-o", str(out), *extra]) == 0
    assert mars_main(["workload-stats", str(out)]) == 0
    return load_workload(out)


def test_codex_rollout_calls_tokens_tools_and_the_users_gap(tmp_path):
    (rollout,) = (DATA / "codex").glob("rollout-*.jsonl")
    lines = [json.loads(x) for x in rollout.read_text().splitlines()]
    usage = [x for x in lines if x["type"] == "token_usage_record"]
    (w,) = _convert(tmp_path, "codex", DATA / "codex")
    assert w.workflow_id == lines[0]["payload"]["id"] and w.arrival_s == 0.0
    assert w.prompt_lengths() == [u["payload"]["usage"]["input_tokens"] for u in usage]
    assert [t.output_tokens for t in w.turns] == [u["payload"]["usage"]["output_tokens"] for u in usage]
    assert [t.tool for t in w.turns] == ["exec_command", "exec_command", "user", "exec_command", "exec_command", None]
    # a tool's time: its function_call to its function_call_output
    started, spans = {}, []
    for x in lines:
        if x["type"] == "response_item" and x["payload"]["type"] == "function_call":
            started[x["payload"]["call_id"]] = _ts(x["timestamp"])
        elif x["type"] == "response_item" and x["payload"]["type"] == "function_call_output":
            spans.append(_ts(x["timestamp"]) - started[x["payload"]["call_id"]])
    tool_turns = [t for t in w.turns if t.tool == "exec_command"]
    assert [t.tool_s for t in tool_turns] == pytest.approx(spans, abs=2e-3)
    # the user's second prompt (codex exec resume): from the answer to the next task_started
    second = [_ts(x["timestamp"]) for x in lines if x["type"] == "event_msg" and x["payload"]["type"] == "task_started"][1]
    assert w.turns[2].tool_s == pytest.approx(second - _ts(usage[2]["timestamp"]), abs=2e-3)
    # --scale divides tokens, not times
    (s,) = _convert(tmp_path, "codex", DATA / "codex", "--scale", "16")
    assert s.prompt_tokens == round(w.prompt_tokens / 16) and [t.tool_s for t in s.turns] == [t.tool_s for t in w.turns]


def test_opencode_store_sessions_sub_agents_and_compaction(tmp_path):
    (w,) = _convert(tmp_path, "opencode", DATA / "opencode")
    con = sqlite3.connect(DATA / "opencode" / "opencode.db")
    root = con.execute("select id from session where parent_id is null").fetchone()[0]
    kids = [r[0] for r in con.execute("select id from session where parent_id = ? order by time_created", (root,))]
    msgs = [json.loads(d) for (d,) in con.execute(
        "select data from message where session_id = ? order by time_created", (root,))]
    asst = [m for m in msgs if m["role"] == "assistant"]
    assert w.workflow_id == root and [c.workflow.workflow_id for c in w.children] == kids
    assert w.prompt_lengths() == [m["tokens"]["input"] + m["tokens"]["cache"]["read"] + m["tokens"]["cache"]["write"]
                                  for m in asst]
    # each sub-agent ran from its parent's task tool call, which waited for it
    assert [(c.after_turn, c.parent_waits) for c in w.children] == [(0, True), (4, True)]
    assert [w.turns[c.after_turn].tool for c in w.children] == ["task", "task"]
    assert all(len(c.workflow.turns) == 3 and c.workflow.turns[0].tool == "bash" for c in w.children)
    # the second prompt's first call recorded a shorter input than the context before it: a compaction
    assert w.turns[3].tool == "user" and w.turns[4].compact is not None
    assert w.meta["compactions"] == 1
    # the same objects as JSON files (OpenCode's layout before its SQLite store) convert the same
    st = tmp_path / "old" / "storage"
    for sid, parent, created in con.execute("select id, parent_id, time_created from session"):
        f = st / "session" / "proj" / f"{sid}.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"id": sid, "parentID": parent, "time": {"created": created}}))
    for table, key in (("message", "session_id"), ("part", "message_id")):
        for rid, owner, sid, data in con.execute(f"select id, {key}, session_id, data from {table}"):
            f = st / table / owner / f"{rid}.json"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps({**json.loads(data), "id": rid, "sessionID": sid,
                                     **({"messageID": owner} if table == "part" else {})}))
    (old,) = sessions.convert_opencode(tmp_path / "old")
    strip = {"source": True, "schema_": True, "children": {"__all__": {"workflow": {"source"}}}}
    assert old.model_dump(exclude=strip) == w.model_dump(exclude=strip)


def test_openhands_conversation_directory(tmp_path):
    (conv,) = [d for d in (DATA / "openhands").iterdir() if d.is_dir()]
    state = json.loads((conv / "base_state.json").read_text())
    usages = state["stats"]["usage_to_metrics"]["agent"]["token_usages"]
    (w,) = _convert(tmp_path, "openhands", DATA / "openhands")
    assert w.workflow_id == state["id"]
    assert w.prompt_lengths() == [u["prompt_tokens"] for u in usages]
    assert [t.output_tokens for t in w.turns] == [u["completion_tokens"] for u in usages]
    # terminal calls, the finish tool, then the user's second message; the same from one conversation dir
    assert [t.tool for t in w.turns] == ["terminal", "terminal", "finish", "terminal", "terminal", None]
    assert w.turns[2].tool_s > 1.0 > w.turns[0].tool_s > 0
    assert _convert(tmp_path, "openhands", conv)[0].model_dump() == w.model_dump()


@pytest.mark.parametrize("frontend", ["codex", "opencode"])
def test_a_converted_session_replays_in_the_sim(tmp_path, frontend):
    (w,) = _convert(tmp_path, frontend, DATA / frontend, "--scale", "16")
    out, _ = run_replay(ReplayConfig(workload=str(tmp_path / f"{frontend}.jsonl"), policy="mars", rps=1.0,
                                     backend="sim", profile="cpu-tiny", progress=False, out=str(tmp_path / "r")))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 1 and summary["errors"] == 0
    events = read_events(out)
    ends = [e for e in events if e["event"] == "call_end"]
    assert len(ends) == sum(len(x.turns) for x in w.walk())
    assert {e["workflow"] for e in ends} == {x.workflow_id for x in w.walk()}
    end = [e for e in events if e["event"] == "run_end"][-1]["engine"]
    assert end["leak_check"] == "ok" and end["free_blocks"] == end["num_blocks"] and end["retained_blocks"] == 0


def test_session_log_errors_name_file_line_field(tmp_path):
    (rollout,) = (DATA / "codex").glob("rollout-*.jsonl")
    lines = rollout.read_text().splitlines()
    k = next(i for i, x in enumerate(lines) if '"token_usage_record"' in x)
    bad = json.loads(lines[k])
    bad["payload"]["usage"]["output_tokens"] = "many"
    lines[k] = json.dumps(bad)
    d = tmp_path / "sessions"
    d.mkdir()
    (d / rollout.name).write_text("\n".join(lines) + "\n")
    with pytest.raises(WorkloadError, match=rf"{rollout.name}:{k + 1}: payload.usage.output_tokens: must be a token count"):
        sessions.convert_codex(d)
    (d / rollout.name).write_text('{"type": "event_msg", "timestamp": "2026-01-01T00:00:00Z", "payload": {}}\n')
    with pytest.raises(WorkloadError, match=r"session_meta: missing: not a Codex rollout file"):
        sessions.convert_codex(d)
    # OpenCode: a database without its tables; a message whose tokens are not numbers
    db = tmp_path / "oc" / "opencode.db"
    db.parent.mkdir()
    sqlite3.connect(db).close()
    with pytest.raises(WorkloadError, match=r"opencode.db: session: cannot read the table"):
        sessions.convert_opencode(db.parent)
    shutil.copy(DATA / "opencode" / "opencode.db", db)
    con = sqlite3.connect(db)
    mid, data = con.execute("select id, data from message where data like '%\"assistant\"%' limit 1").fetchone()
    m = json.loads(data)
    m["tokens"]["input"] = -3
    con.execute("update message set data = ? where id = ?", (json.dumps(m), mid))
    con.commit()
    con.close()
    with pytest.raises(WorkloadError, match=rf"opencode.db: message\[{mid}\].tokens.input: must be a token count"):
        sessions.convert_opencode(db.parent)
    # OpenHands: an event that is not JSON names its file
    conv = tmp_path / "oh" / "c1"
    shutil.copytree(next(p for p in (DATA / "openhands").iterdir() if p.is_dir()), conv)
    ev = sorted((conv / "events").glob("event-*.json"))[2]
    ev.write_text("{oops")
    with pytest.raises(WorkloadError, match=rf"{ev.name}:1: invalid JSON"):
        sessions.convert_openhands(conv.parent)
    with pytest.raises(FileNotFoundError, match="no conversation directories"):
        sessions.convert_openhands(tmp_path)


@pytest.mark.skipif(not (AGENTS_BIN / "codex").exists() or not (AGENTS_BIN / "opencode").exists(),
                    reason="the agent CLIs are not installed (scripts/setup_agents.sh)")
def test_logs_of_the_installed_clis_convert(tmp_path, monkeypatch):
    """Codex and OpenCode as installed now write the logs the converters read: the capture script
    runs both (two tool calls per prompt, a resumed second prompt; OpenCode delegates to a sub-agent)."""
    spec = importlib.util.spec_from_file_location("capture_sessions", DATA / "capture_sessions.py")
    cap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cap)
    monkeypatch.delenv("OPENHANDS_PYTHON", raising=False)
    cap.main(tmp_path)
    (cx,) = sessions.convert_codex(tmp_path / "_codex_run" / "home" / ".codex" / "sessions")
    assert [t.tool for t in cx.turns] == ["exec_command", "exec_command", "user", "exec_command", "exec_command", None]
    (oc,) = sessions.convert_opencode(tmp_path / "_opencode_run" / "home" / ".local" / "share" / "opencode")
    assert [t.tool for t in oc.turns].count("bash") == 4 and len(oc.children) == 2
    assert all(c.workflow.turns[0].tool == "bash" for c in oc.children)
