"""Real agents doing real work through ``mars serve`` with the scripted model (issue 30).

``mars serve --scripted benchmark/tasks/coding.jsonl`` makes the tiny model play each task's
solution as tool calls in its own format; the frontends (the Codex CLI, OpenCode, the OpenHands SDK,
installed by scripts/setup_agents.sh) run the tools for real in their sandboxed workspaces. Each
test runs one session of one task and checks: at least 3 real tool calls, the task's own check
passes in the workspace afterwards, the session was exactly one sidecar workflow (the client's own
session id), and its admission slot was freed within a second of the session's last answer.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from pathlib import Path

import pytest
from test_frontends import MarsServe, _bwrap_ok, _installed
from vllm_mars.agents.runner import AgentRunConfig, run_agents

TASKS = Path(__file__).resolve().parents[1] / "benchmark" / "tasks" / "coding.jsonl"


class ScriptedServe(MarsServe):
    """`mars serve --scripted` with the task set, vLLM's own sizing of the CPU default context."""

    SERVE_ARGS = ("--scripted", str(TASKS), "--default-max-tokens", "512")


@pytest.fixture(scope="module")
def scripted_serve(tiny_model, tmp_path_factory):
    if not any(_installed(f) for f in ("codex", "opencode", "openhands")):
        pytest.skip("no agent frontend installed: run scripts/setup_agents.sh (CI does)")
    tmp = tmp_path_factory.mktemp("scripted")
    srv = ScriptedServe(tiny_model, tmp)
    try:
        srv.wait_ready(400)
        log = srv.log_path.read_text()
        # the run says it is scripted, and the defaults serve the frontends' first prompts
        assert "mars serve: scripted model" in log and "max_model_len 32768" in log
        yield srv
    finally:
        srv.stop()


def _one_task(tmp_path: Path, task_id: str) -> Path:
    rows = [x for x in TASKS.read_text().splitlines() if json.loads(x)["task_id"] == task_id]
    f = tmp_path / f"{task_id}.jsonl"
    f.write_text(rows[0] + "\n")
    return f


@pytest.mark.parametrize(("frontend", "task"), [("codex", "calc-add"), ("opencode", "fizzbuzz"),
                                                ("openhands", "palindrome")])
def test_a_real_session_solves_its_task_through_mars_serve(scripted_serve, tmp_path, frontend, task):
    if _installed(frontend) is None:
        pytest.skip(f"the {frontend} frontend is not installed: run scripts/setup_agents.sh (CI does)")
    srv = scripted_serve
    out = run_agents(AgentRunConfig(frontend=frontend, tasks=str(_one_task(tmp_path, task)), server=srv.url,
                                    session_timeout_s=600, unsandboxed=not _bwrap_ok(), max_output_tokens=1024,
                                    scripted=str(TASKS), out=str(tmp_path / "run")))
    (t,) = [json.loads(x) for x in (out / "traces.jsonl").read_text().splitlines()]
    assert t["error"] is None, t["cli"]
    assert t["tool_calls"] >= 3, t["cli"]  # the frontend really ran tools the model asked for
    assert t["solved"] is True  # the task's own check passes in the workspace afterwards
    ws = out / "sessions" / task / "workspace"
    row = json.loads(_one_task(tmp_path, task).read_text())
    assert subprocess.run(row["payload"]["check"], shell=True, cwd=ws, capture_output=True,
                          check=False).returncode == 0
    # the prompts grew with the tool outputs: each agent call's prompt is longer than the one before
    agent = [c for c in t["calls"] if c["has_tools"]]
    assert len(agent) >= 4 and all(b["prompt_tokens"] > a["prompt_tokens"] for a, b in itertools.pairwise(agent))
    # exactly one workflow: the client's own session id, on every call
    assert t["sidecar_workflows"] == [t["client_session"]]
    assert {r["workflow"] for r in srv.arrivals() if r["workflow"] == t["client_session"]} == {t["client_session"]}
    # its slot was freed within a second of the session's last answer (same monotonic clock)
    t0 = next(json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()
              if json.loads(x)["event"] == "run_start")["monotonic_t0"]
    last = t0 + max(c["end_ts"] for c in t["calls"])
    ends: list[dict] = []
    deadline = time.monotonic() + 5
    while not ends and time.monotonic() < deadline:
        ends = [e for e in map(json.loads, srv.events.read_text().splitlines())
                if e["event"] == "workflow_end_inferred" and e["workflow"] == t["client_session"]]
        time.sleep(0.1)
    assert ends, "the session's workflow never ended"
    assert ends[0]["ts"] - last <= 1.0, (ends[0], last)
    report = (out / "report.md").read_text()
    assert "## Sessions" in report and "The model was scripted" in report and "Task completion: 1/1" in report
    # what happened, as a replayable workload: one workflow, a turn per agent call
    (w,) = [json.loads(x) for x in (out / "workload.jsonl").read_text().splitlines()]
    assert len(w["turns"]) == len(agent) and w["meta"]["frontend"] == frontend
