"""Real agent frontends through ``mars serve``: the Codex CLI and OpenCode, installed by
scripts/setup_agents.sh, driven by ``mars agents run`` against the tiny model.

The tiny model's answers are junk text with no tool call, so each CLI turn is one call (OpenCode adds
its title call) and the session ends there; calls that send no output limit (Codex) get 8 tokens
(``--default-max-tokens``). The CLI tests skip only when the CLIs are not installed; the sandbox
test needs bubblewrap. Sessions that do real work (the scripted model): tests/test_agents_live.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess, free_port
from vllm_mars.agents.config import AgentRunConfig, plan_sessions
from vllm_mars.agents.frontends import CliSettings, Codex, OpenCode, SessionPaths, get_frontend
from vllm_mars.agents.proxy import usage_from_tail
from vllm_mars.agents.runner import run_agents
from vllm_mars.agents.sandbox import BRIDGE_PORT, find_cli, sandbox_mode, sandboxed_argv
from vllm_mars.agents.tasks import load_agent_tasks
from vllm_mars.agents.traces import session_workflow, write_workload
from vllm_mars.engine.tool_calling import choose_tool_parser
from vllm_mars.workload.schema import WorkloadError


def _installed(name: str) -> str | None:
    try:
        return find_cli(get_frontend(name))
    except FileNotFoundError:
        return None


def need_cli(name: str):
    return pytest.mark.skipif(_installed(name) is None,
                              reason=f"the {name} CLI is not installed: run scripts/setup_agents.sh (CI does)")


def _bwrap_ok() -> bool:
    from vllm_mars.driver.tools import detect_sandbox

    return detect_sandbox() == "bwrap"


# -- units --------------------------------------------------------------------------------------------
def test_tool_parser_fits_the_model(tiny_model):
    assert choose_tool_parser(tiny_model).parser == "hermes"  # a Qwen3 (config.json model_type)
    assert choose_tool_parser("/m/Qwen3-Coder-30B-A3B-Instruct").parser == "qwen3_coder"
    assert choose_tool_parser("x", served_model_name="Qwen/Qwen3-Coder-480B").parser == "qwen3_coder"
    assert choose_tool_parser("Qwen/Qwen3-32B").parser == "hermes"
    assert choose_tool_parser(tiny_model, override="none").server_args() == []
    c = choose_tool_parser(tiny_model, override="qwen3_xml")
    assert c.server_args() == ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml"]
    assert "guess" in choose_tool_parser("/nowhere/some-model").reason


def test_task_files(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("# comment\nfix the bug\n\nadd a test\n")
    assert [t.prompts for t in load_agent_tasks(p)] == [("fix the bug",), ("add a test",)]
    j = tmp_path / "p.json"
    j.write_text(json.dumps([["start", "go on"], "alone"]))
    assert [t.prompts for t in load_agent_tasks(j)] == [("start", "go on"), ("alone",)]
    m = tmp_path / "t.jsonl"
    m.write_text(json.dumps({"schema": "mas_task_v1", "task_id": "t1", "payload": {"text": "make it pass"},
                             "workspace_init": [{"path": "a.py", "content": "x = 1\n"}]}) + "\n")
    (t,) = load_agent_tasks(m)
    assert t.task_id == "t1" and "a.py" in t.prompts[0] and "make it pass" in t.prompts[0]
    assert t.files[0].path == "a.py"
    j.write_text(json.dumps(["ok", ["fine", 3]]))
    with pytest.raises(WorkloadError, match=r"\[1\]\[1\]"):
        load_agent_tasks(j)
    with pytest.raises(FileNotFoundError):
        load_agent_tasks(tmp_path / "none.txt")


def test_cli_output_and_usage_parsing():
    codex = "\n".join(json.dumps(e) for e in [
        {"type": "thread.started", "thread_id": "thr-1"}, {"type": "turn.started"},
        {"type": "item.completed", "item": {"id": "i1", "type": "agent_message", "text": "done"}},
        {"type": "turn.completed", "usage": {"input_tokens": 100, "cached_input_tokens": 64, "output_tokens": 8}}])
    o = Codex().parse("WARNING: not json\n" + codex)
    assert (o.session_id, o.final_text, o.input_tokens, o.cached_tokens, o.output_tokens, o.steps, o.other_lines) \
        == ("thr-1", "done", 100, 64, 8, 1, 1)
    oc = "\n".join(json.dumps(e) for e in [
        {"type": "step_start", "sessionID": "ses_1", "part": {"type": "step-start"}},
        {"type": "text", "sessionID": "ses_1", "part": {"type": "text", "text": "hi"}},
        {"type": "step_finish", "sessionID": "ses_1", "part": {"type": "step-finish", "reason": "stop", "tokens": {
            "input": 50, "output": 4, "cache": {"read": 32, "write": 0}}}}])
    o = OpenCode().parse(oc)
    assert (o.session_id, o.final_text, o.input_tokens, o.cached_tokens, o.output_tokens) == ("ses_1", "hi", 50, 32, 4)
    chat = b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,' \
           b'"prompt_tokens_details":{"cached_tokens":8}}}\n\ndata: [DONE]\n\n'
    assert usage_from_tail(chat) == {"prompt_tokens": 12, "output_tokens": 3, "cached_tokens": 8}
    resp = b'event: response.completed\ndata: {"response":{"usage":{"input_tokens":20,"input_tokens_details":' \
           b'{"cached_tokens":16},"output_tokens":5,"total_tokens":25}}}\n\n'
    assert usage_from_tail(resp) == {"prompt_tokens": 20, "output_tokens": 5, "cached_tokens": 16}
    assert usage_from_tail(b"") == {"prompt_tokens": None, "output_tokens": None, "cached_tokens": None}


# The identity each frontend sends, as captured on the wire (Codex CLI 0.171.0 and OpenCode 1.18.33
# against `mars serve`; OpenHands SDK >= 1.25 from its source: it is not installable here).
CODEX_WIRE = {"session-id": "019a-thr", "thread-id": "019a-thr", "x-client-request-id": "019a-thr",
              "x-codex-window-id": "019a-thr:0", "originator": "codex_exec",
              "x-codex-turn-metadata": '{"session_id":"019a-thr","thread_id":"019a-thr","turn_id":"t1"}',
              "user-agent": "codex_exec/0.171.0 (Debian 12.0.0; x86_64) dumb (codex_exec; 0.171.0)"}
OPENCODE_WIRE = {"x-session-affinity": "ses_dd06", "x-session-id": "ses_dd06",
                 "user-agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"}
OPENHANDS_WIRE = {"x-litellm-session-id": "conv-7", "user-agent": "litellm/1.80.0"}


def test_wire_identity_of_each_frontend():
    from vllm_mars.admission.continuity import Continuity
    from vllm_mars.admission.identity import identify

    responses = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                 "instructions": "codex base instructions", "prompt_cache_key": "019a-thr", "tools": [{}],
                 "tool_choice": "auto", "stream": True, "store": False}
    i = identify(CODEX_WIRE, responses)
    assert (i.workflow, i.root, i.parent, i.source) == ("019a-thr", "019a-thr", None, "codex")
    sub = identify({**CODEX_WIRE, "session-id": "019b-sub", "thread-id": "019b-sub",
                    "x-codex-parent-thread-id": "019a-thr", "x-openai-subagent": "collab_spawn"}, responses)
    assert (sub.workflow, sub.root, sub.parent) == ("019b-sub", "019a-thr", "019a-thr")
    chat_body = {"model": "m", "messages": [{"role": "system", "content": "You are opencode"},
                                            {"role": "user", "content": "fix"}],
                 "tools": [{}], "tool_choice": "auto", "stream": True, "stream_options": {"include_usage": True}}
    i = identify(OPENCODE_WIRE, chat_body)
    assert (i.workflow, i.root, i.source) == ("ses_dd06", "ses_dd06", "opencode")
    child = identify({**OPENCODE_WIRE, "x-session-id": "ses_kid", "x-session-affinity": "ses_kid",
                      "x-parent-session-id": "ses_dd06"}, chat_body)
    assert (child.workflow, child.root, child.parent) == ("ses_kid", "ses_dd06", "ses_dd06")
    c = Continuity()  # a child session is never renamed by the prefix check
    assert c.check(child, chat_body)[0] == child
    oh = {"model": "m", "messages": chat_body["messages"], "prompt_cache_key": "conv-7"}
    i = identify(OPENHANDS_WIRE, oh)
    assert (i.workflow, i.root, i.source) == ("conv-7", "conv-7", "openhands")
    kid = identify({**OPENHANDS_WIRE, "x-litellm-session-id": "conv-8"}, oh)  # a sub-agent keeps the root's key
    assert (kid.workflow, kid.root, kid.parent) == ("conv-8", "conv-7", "conv-7")


def test_cli_configs_point_at_the_proxy(tmp_path):
    s = CliSettings(base_url="http://127.0.0.1:8000/v1", model="tiny", max_output_tokens=16)
    paths = SessionPaths(tmp_path / "s").make()
    Codex().write_config(paths, s)
    toml = (paths.home / ".codex" / "config.toml").read_text()
    import tomllib

    cfg = tomllib.loads(toml)
    prov = cfg["model_providers"][cfg["model_provider"]]
    assert prov["wire_api"] == "responses" and prov["base_url"] == s.base_url and cfg["model"] == "tiny"
    assert cfg["check_for_update_on_startup"] is False and cfg["analytics"]["enabled"] is False
    OpenCode().write_config(paths, s)
    oc = json.loads((paths.home / "opencode.json").read_text())
    mars = oc["provider"]["mars"]
    assert mars["npm"] == "@ai-sdk/openai-compatible" and mars["options"]["baseURL"] == s.base_url
    assert mars["models"]["tiny"]["limit"]["output"] == 16 and oc["small_model"] == "mars/tiny"
    assert Codex().argv("codex", "p", resume="thr-1")[-3:] == ["resume", "thr-1", "p"]
    assert OpenCode().argv("opencode", "p", continue_last=True)[-2:] == ["--continue", "p"]


def test_bad_agents_run_arguments_exit_2(tmp_path, capsys):
    from vllm_mars.cli import main

    tasks = tmp_path / "t.txt"
    tasks.write_text("hi\n")
    base = ["agents", "run", "--tasks", str(tasks), "--server", "http://127.0.0.1:9"]
    assert main([*base, "--frontend", "codex", "--concurrency", "0"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["agents", "run", "--frontend", "codex", "--tasks", str(tmp_path / "no.txt"),
                 "--server", "http://127.0.0.1:9", "--agents-prefix", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no.txt" in err or "setup_agents.sh" in err
    assert main([*base, "--frontend", "codex", "--server", "127.0.0.1:9"]) == 2
    assert "http://" in capsys.readouterr().err
    assert main([*base, "--frontend", "codex", "--rps", "0"]) == 2
    assert "--rps must be > 0" in capsys.readouterr().err
    assert main([*base, "--frontend", "codex,nope"]) == 2
    assert "'nope' unknown; allowed: codex, opencode, openhands" in capsys.readouterr().err
    assert main(["agents", "run", "--tasks", str(tasks), "--frontend", "codex"]) == 2
    assert "--model-path" in capsys.readouterr().err
    assert main(["agents", "compare", "--policies", "mars,nosuch", "--tasks", str(tasks), "--frontend", "codex",
                 "--model-path", "m"]) == 2
    assert "nosuch" in capsys.readouterr().err


def test_a_live_session_becomes_a_replayable_workflow(tmp_path):
    from vllm_mars.workload.schema import WorkloadLine

    def call(t, prompt, out, tools=True):
        return {"has_tools": tools, "prompt_tokens": prompt, "output_tokens": out, "submit_ts": t, "end_ts": t + 1}

    trace = {"task": "s1", "task_id": "calc-add", "frontend": "codex", "start_ts": 5.0, "client_session": "c",
             "solved": True, "side_calls": 1,
             "calls": [call(5, 100, 10, tools=False), call(6, 1000, 20), call(9, 1100, 30), call(12, 400, 5)]}
    w = session_workflow(trace)
    assert w["prompt_tokens"] == 1000 and w["schema"] == "mars_workload_v2"  # the side call is left out
    assert w["turns"][0] == {"output_tokens": 20, "tool_s": 2.0}  # the gap to the next call: tool time
    assert w["turns"][1] == {"output_tokens": 30, "append_tokens": 80, "tool_s": 2.0}  # 1100 - (1000 + 20)
    assert w["turns"][2] == {"output_tokens": 5, "compact": {"keep_tokens": 400, "summary_tokens": 0}}
    assert WorkloadLine.model_validate(w).prompt_lengths() == [1000, 1100, 400]
    later = {**trace, "task": "s2", "start_ts": 8.0}
    assert write_workload([later, trace, {**trace, "task": "none", "calls": []}], tmp_path / "w.jsonl") == 2
    rows = [json.loads(x) for x in (tmp_path / "w.jsonl").read_text().splitlines()]
    assert [(r["workflow_id"], r["arrival_s"]) for r in rows] == [("s1", 0.0), ("s2", 3.0)]


def test_session_plan_mixes_frontends_and_arrives_open_loop(tmp_path):

    tasks = load_agent_tasks(Path(__file__).resolve().parents[1] / "benchmark" / "tasks" / "coding.jsonl")
    cfg = AgentRunConfig(frontend="openhands,codex,opencode", tasks="t", model_path="m", rps=2.0, max_requests=16)
    plan = plan_sessions(cfg, tasks)
    assert len(plan) == 16 and len({s.key for s in plan}) == 16
    assert [s.frontend for s in plan[:4]] == ["openhands", "codex", "opencode", "openhands"]
    assert [s.task.task_id for s in plan[11:14]] == [tasks[11].task_id, tasks[0].task_id, tasks[1].task_id]
    assert [s.offset for s in plan[:3]] == [0.0, 0.5, 1.0]  # fixed: i / rps
    poisson = plan_sessions(AgentRunConfig(frontend="codex", tasks="t", server="http://x", rps=2.0,
                                           arrival="poisson", max_requests=5, seed=3), tasks)
    offs = [s.offset for s in poisson]
    assert offs[0] == 0.0 and offs == sorted(offs) and len(set(offs)) == 5
    # one frontend, one session per task: the session is named as its task
    assert [s.key for s in plan_sessions(AgentRunConfig(frontend="codex", tasks="t", server="http://x"), tasks)] \
        == [t.task_id for t in tasks]


# -- the sandbox --------------------------------------------------------------------------------------
def test_no_bwrap_means_no_run_unless_unsandboxed(monkeypatch):
    from vllm_mars.agents import sandbox

    monkeypatch.setattr(sandbox, "detect_sandbox", lambda: "landlock")  # Landlock cannot cut the network
    with pytest.raises(ValueError, match="--unsandboxed"):
        sandbox_mode(False)
    mode, why = sandbox_mode(True)
    assert mode == "none" and "--unsandboxed" in why  # written to run_start and a sandbox_off event


PROBE = r"""
import json, socket, sys
out = {}
def tcp(port):
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port)); s.sendall(b"ping"); return s.recv(16).decode()
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
out["bridge"] = tcp(int(sys.argv[1]))
out["host_port"] = tcp(int(sys.argv[2]))
for name, path in (("workspace", "mine.txt"), ("tmp", sys.argv[3]), ("outside", sys.argv[4])):
    try:
        open(path, "w").write("x"); out[name] = "written"
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""


@pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap (bwrap) is not usable here")
def test_sandbox_allows_only_the_bridge_and_the_workspace(tmp_path):
    """A sandboxed session reaches 127.0.0.1:BRIDGE_PORT (-> the proxy's Unix socket) and nothing else:
    not a port listening on the host's loopback; it writes in its workspace and nowhere else."""
    import tempfile

    sock_dir = tempfile.mkdtemp(prefix="mars-agent-test-")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"{sock_dir}/proxy.sock")
    unix.listen(1)
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(1)

    def answer():
        c, _ = unix.accept()
        c.sendall(b"pong:" + c.recv(4))
        c.close()

    threading.Thread(target=answer, daemon=True).start()
    paths = SessionPaths(tmp_path / "s").make()
    in_tmp = tmp_path / "outside.txt"  # /tmp is the sandbox's own tmpfs: written there, gone after
    outside = Path(__file__).resolve().parent / f".sandbox-probe-{os.getpid()}"  # the read-only root
    argv = sandboxed_argv([sys.executable, "-c", PROBE, str(BRIDGE_PORT), str(host.getsockname()[1]),
                           str(in_tmp), str(outside)], paths, sock_dir)
    r = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["bridge"] == "pong:ping"
    assert out["host_port"] == "ConnectionRefusedError"  # the host's loopback is not the sandbox's
    assert out["workspace"] == "written" and (paths.workspace / "mine.txt").exists()
    assert not in_tmp.exists()
    assert out["outside"] in ("OSError", "PermissionError") and not outside.exists()
    unix.close()
    host.close()


# -- the real CLIs through `mars serve` ---------------------------------------------------------------
class MarsServe(ServerProcess):
    """`mars serve` (vLLM + MarsScheduler + the sidecar) with the tiny model, as a user starts it;
    ``wait_ready`` and ``stop`` (SIGTERM: mars serve then stops its vLLM) are the shared server's."""

    #: the sizing and output flags of this server (a subclass serves with others)
    SERVE_ARGS: tuple[str, ...] = ("--num-blocks", "2048", "--max-model-len", "32768", "--default-max-tokens", "8")

    def __init__(self, model: str, tmp: Path) -> None:
        self.port, engine_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sched_log, self.events, self.log_path = tmp / "sched.jsonl", tmp / "admission.jsonl", tmp / "serve.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_mars.cli", "serve", model, "--port", str(self.port),
             "--engine-port", str(engine_port), "--served-model-name", "tiny", "--device", "cpu",
             "--max-num-seqs", "8", "--telemetry-interval", "0.1", "--events", str(self.events),
             "--engine-log", str(tmp / "engine.log"), *self.SERVE_ARGS],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MARS_SCHED_LOG": str(self.sched_log)})

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not on /metrics")

    def arrivals(self) -> list[dict]:
        recs = [json.loads(x) for x in self.sched_log.read_text().splitlines() if x.strip()]
        return [r for r in recs if r["event"] == "arrive"]


@pytest.fixture(scope="module")
def mars_serve(tiny_model, tmp_path_factory):
    srv = MarsServe(tiny_model, tmp_path_factory.mktemp("serve"))
    try:
        srv.wait_ready(300)
        assert "tool calling on, parser hermes" in srv.log_path.read_text()
        # the scheduler is told the same parser, to read the next tool from outputs (issue 10; an
        # engine that did not take the key would have refused to start)
        assert "the scheduler reads each call's next tool with parser hermes" in srv.log_path.read_text()
        yield srv
    finally:
        srv.stop()


def _run(frontend: str, srv: MarsServe, tmp_path: Path, tasks: list, **kw) -> tuple[Path, list[dict]]:
    f = tmp_path / "tasks.json"
    f.write_text(json.dumps(tasks))
    out = run_agents(AgentRunConfig(frontend=frontend, tasks=str(f), server=srv.url, concurrency=len(tasks),
                                    session_timeout_s=240, unsandboxed=not _bwrap_ok(), out=str(tmp_path / "run"),
                                    **kw))
    traces = [json.loads(x) for x in (out / "traces.jsonl").read_text().splitlines()]
    return out, sorted(traces, key=lambda t: t["task"])


def _check_run(srv: MarsServe, out: Path, traces: list[dict], frontend: str) -> None:
    assert [t["error"] for t in traces] == [None, None], [t["cli"] for t in traces]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 2 and summary["policy"] == f"agents-{frontend}"
    assert "## Sessions" in (out / "report.md").read_text()
    a, b = traces
    sa, sb = a["client_session"], b["client_session"]
    assert sa and sb and sa != sb  # two concurrent sessions: two sessions ...
    # ... and resuming kept the first one's session (both CLI runs of task-0 report it)
    assert [r["client_session"] for r in a["cli"]] == [sa, sa]
    # the engine saw each session as one workflow named as the client calls its session
    by_wf: dict[str, list[int]] = {}
    for r in srv.arrivals():
        if r["workflow"] in (sa, sb):
            assert r["root"] == r["workflow"]
            by_wf.setdefault(r["workflow"], []).append(r["turn"])
    na, nb = len(a["calls"]), len(b["calls"])
    assert len(by_wf[sa]) == na >= 2 and len(by_wf[sb]) == nb >= 1
    assert sorted(by_wf[sa]) == list(range(na))  # one workflow across the resume: turns go on
    # the sidecar told each call the workflow it assigned: the client's session, every call
    assert a["sidecar_workflows"] == [sa] and b["sidecar_workflows"] == [sb]
    assert all(c["workflow"] == c["root"] == t["client_session"] for t in traces for c in t["calls"])
    # each session's final answer (no tool call) released its slot: no idle timeout (600 s) needed
    deadline = time.monotonic() + 10
    while srv.metric("mars_admission_active") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.metric("mars_admission_active") == 0 and srv.metric("mars_admission_queued") == 0
    evs = [json.loads(x) for x in srv.events.read_text().splitlines()]
    ends = [e for e in evs if e["event"] == "workflow_end_inferred" and e["workflow"] in (sa, sb)]
    assert {e["workflow"] for e in ends} == {sa, sb} and {e["reason"] for e in ends} == {"final_answer"}
    assert len([e for e in ends if e["workflow"] == sa]) == 2  # ended, resumed, ended again
    assert [e["workflow"] for e in evs if e["event"] == "workflow_resumed" and e["workflow"] in (sa, sb)] == [sa]


def test_mars_serve_takes_tool_choice_auto_and_ends_the_turn_on_a_final_answer(mars_serve):
    """What OpenCode sends, by hand: tools with tool_choice "auto" is accepted (tool calling is on by
    default), the answer without a tool call ends the workflow softly (its slot is free at once), and
    the session's next call continues it, turn counter and all."""
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, "tool_choice": "auto",
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}],
            "messages": [{"role": "system", "content": "agent"}, {"role": "user", "content": "fin-task"}]}
    h = {"x-session-id": "ses_fin", "x-session-affinity": "ses_fin"}
    for k in range(2):
        with httpx.stream("POST", mars_serve.url + "/v1/chat/completions", json=body, headers=h, timeout=60) as r:
            assert r.status_code == 200 and r.headers["x-mars-workflow"] == "ses_fin"
            assert "tool_calls" not in "".join(r.iter_text())  # the tiny model's junk: a final answer
        deadline = time.monotonic() + 5
        while mars_serve.metric("mars_admission_active") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mars_serve.metric("mars_admission_active") == 0
        body["messages"].append({"role": "user", "content": f"go on {k}"})
    assert [(r["workflow"], r["turn"]) for r in mars_serve.arrivals() if r["workflow"] == "ses_fin"] == \
        [("ses_fin", 0), ("ses_fin", 1)]
    evs = [json.loads(x) for x in mars_serve.events.read_text().splitlines()]
    assert [e["reason"] for e in evs if e["event"] == "workflow_end_inferred" and e["workflow"] == "ses_fin"] == \
        ["final_answer", "final_answer"]
    assert [e["workflow"] for e in evs if e["event"] == "workflow_resumed"].count("ses_fin") == 1


@need_cli("codex")
def test_codex_sessions_through_mars_serve(mars_serve, tmp_path):
    out, traces = _run("codex", mars_serve, tmp_path, [["say hi", "and again"], "write a haiku"])
    _check_run(mars_serve, out, traces, "codex")
    sent = traces[0]["calls"][0]["sent"]
    assert sent["session-id"] == sent["thread-id"] == sent["prompt_cache_key"] == traces[0]["client_session"]
    assert all(c["path"] == "/v1/responses" and c["status"] == 200 for t in traces for c in t["calls"])


@need_cli("opencode")
def test_opencode_sessions_through_mars_serve(mars_serve, tmp_path):
    out, traces = _run("opencode", mars_serve, tmp_path, [["say hi", "and again"], "write a haiku"],
                       resume_last=True, max_output_tokens=8)
    _check_run(mars_serve, out, traces, "opencode")
    a = traces[0]
    sent = a["calls"][0]["sent"]
    assert sent["x-session-id"] == sent["x-session-affinity"] == a["client_session"]
    # tool_choice "auto" is accepted (mars serve enabled tool calling): every call 200
    assert all(c["path"] == "/v1/chat/completions" and c["status"] == 200 for t in traces for c in t["calls"])
    # the first call of a session is OpenCode's title generation: no tools, a short prompt
    first, agent = a["calls"][0], a["calls"][1]
    assert not first["has_tools"] and agent["has_tools"] and first["prompt_tokens"] < agent["prompt_tokens"]


def test_mars_serve_reports_what_a_roots_first_call_found_cached(mars_serve):
    """`mars serve` starts vLLM with --enable-prompt-tokens-details, so the sidecar reads each root's
    first-call prefix hit from the usage (KV shared with another workflow) and hands it to the
    admission controller (an ``admission_shared`` event): the second of two roots with the same
    long system prompt finds it cached."""
    system = "shared system prompt " * 40
    for wf in ("ses_shared_a", "ses_shared_b"):
        body = {"model": "tiny", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": wf}]}
        with httpx.stream("POST", mars_serve.url + "/v1/chat/completions", json=body,
                          headers={"x-mars-workflow": wf}, timeout=60) as r:
            text = "".join(r.iter_text())
            assert r.status_code == 200 and '"prompt_tokens_details"' in text
    deadline = time.monotonic() + 10
    shared: dict[str, int] = {}
    while len(shared) < 2 and time.monotonic() < deadline:
        evs = [json.loads(x) for x in mars_serve.events.read_text().splitlines()]
        shared = {e["workflow"]: e["cached_tokens"] for e in evs if e["event"] == "admission_shared"
                  and e["workflow"] in ("ses_shared_a", "ses_shared_b")}
        time.sleep(0.1)
    assert shared["ses_shared_a"] == 0 and shared["ses_shared_b"] >= 128, shared
