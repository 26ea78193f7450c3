"""Capture small real session logs of Codex and OpenCode for the converter tests (provenance of
tests/data/sessions/; see README.md there). Not run by the test suite.

The real CLIs (the pinned versions of scripts/setup_agents.sh) run against a scripted
OpenAI-compatible endpoint on 127.0.0.1 that answers each session's calls with two shell tool calls
and then a final answer (the tiny random model never calls a tool), so the CLIs really run the
tools and write their own session stores (Codex: $CODEX_HOME/sessions/.../rollout-*.jsonl;
OpenCode: $XDG_DATA_HOME/opencode/opencode.db; OpenHands, when OPENHANDS_PYTHON names a venv with
openhands-sdk/openhands-tools 1.58.2: a persistence directory of conversations). Each session gets a
second user prompt (resumed); OpenCode's first step delegates to a sub-agent (its task tool).
Usage: [OPENHANDS_PYTHON=...] python capture_sessions.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BIN = REPO / ".agents" / "node_modules" / ".bin"
STEPS = ["ls -1 && sleep 0.4", "echo checked > note.txt && sleep 0.8"]
calls: dict[str, int] = {}
FIRST: dict[str, str] = {}
LOCK = threading.Lock()


def _step(key: str) -> int:
    with LOCK:
        calls[key] = calls.get(key, 0) + 1
        return calls[key] - 1


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _sse(self, events: list[tuple[str | None, dict | str]]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        for name, data in events:
            if name:
                self.wfile.write(f"event: {name}\n".encode())
            self.wfile.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())
        self.wfile.flush()
        self.close_connection = True

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        n_in = len(json.dumps(req)) // 4
        if self.path.endswith("/responses"):
            self._responses(req, n_in)
        else:
            self._chat(req, n_in)

    def _responses(self, req, n_in):
        key = self.headers.get("session_id") or self.headers.get("session-id") or "codex"
        k = _step(key)
        tools = {t.get("name") for t in req.get("tools", []) if isinstance(t, dict)}
        rid = f"resp_{key[:8]}_{k}"
        if k < len(STEPS):
            if "shell" in tools:
                name, args = "shell", {"command": ["bash", "-lc", STEPS[k]]}
            elif "shell_command" in tools:
                name, args = "shell_command", {"command": STEPS[k]}
            else:
                name, args = "exec_command", {"cmd": STEPS[k]}
            item = {"type": "function_call", "id": f"fc_{k}", "call_id": f"call_{key[:8]}_{k}", "name": name,
                    "arguments": json.dumps(args), "status": "completed"}
        else:
            item = {"type": "message", "id": f"msg_{k}", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "Done: listed the files and wrote note.txt.",
                                 "annotations": []}]}
        usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 24 + 8 * k,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + 24 + 8 * k}
        self._sse([("response.created", {"type": "response.created", "response": {"id": rid}}),
                   ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0,
                                                  "item": item}),
                   ("response.completed", {"type": "response.completed",
                                           "response": {"id": rid, "usage": usage}})])

    def _chat(self, req, n_in):
        key = (self.headers.get("x-session-id") or self.headers.get("x-litellm-session-id")
               or req.get("prompt_cache_key") or "chat")
        has_tools = bool(req.get("tools"))
        k = _step(key) if has_tools else -1
        base = {"id": f"chat_{key[-6:]}_{_step('ids')}", "object": "chat.completion.chunk",
                "model": req.get("model", "tiny")}
        out = 20 + 8 * max(k, 0)
        if not has_tools:  # title generation
            delta, finish = {"role": "assistant", "content": "Listing files"}, "stop"
        elif k == 0 and key == FIRST.setdefault("opencode", key) and any(
                t.get("function", {}).get("name") == "task" for t in req["tools"]):
            # the parent's first step delegates to a sub-agent (OpenCode's task tool: a child session)
            args = {"description": "list files", "prompt": "List the files.", "subagent_type": "general"}
            delta = {"role": "assistant", "tool_calls": [{"index": 0, "id": f"call_{key[-4:]}_{k}", "type": "function",
                     "function": {"name": "task", "arguments": json.dumps(args)}}]}
            finish = "tool_calls"
        elif k < len(STEPS) + (key == FIRST.get("opencode")):
            step = STEPS[k - (key == FIRST.get("opencode"))]
            names = {t.get("function", {}).get("name") for t in req["tools"]}
            name = "bash" if "bash" in names else "terminal"  # OpenCode / OpenHands
            delta = {"role": "assistant", "tool_calls": [{"index": 0, "id": f"call_{key[-4:]}_{k}", "type": "function",
                     "function": {"name": name, "arguments": json.dumps(
                         {"command": step, "description": f"step {k}"} if name == "bash"
                         else {"command": step, "security_risk": "LOW"})}}]}
            finish = "tool_calls"
        elif any(t.get("function", {}).get("name") == "finish" for t in req["tools"]):  # OpenHands ends so
            delta = {"role": "assistant", "tool_calls": [{"index": 0, "id": f"call_{key[-4:]}_{k}", "type": "function",
                     "function": {"name": "finish", "arguments": json.dumps(
                         {"message": "Done: listed the files and wrote note.txt."})}}]}
            finish = "tool_calls"
        else:
            delta, finish = {"role": "assistant", "content": "Done: listed the files and wrote note.txt."}, "stop"
        if not req.get("stream"):
            msg = {k2: v for k2, v in delta.items() if k2 != "tool_calls"}
            if "tool_calls" in delta:
                msg["tool_calls"] = [{kk: vv for kk, vv in tc.items() if kk != "index"} for tc in delta["tool_calls"]]
                msg.setdefault("content", None)
            body = json.dumps({**base, "object": "chat.completion", "created": 0,
                               "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                               "usage": {"prompt_tokens": n_in, "completion_tokens": out,
                                         "total_tokens": n_in + out}}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._sse([(None, {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}),
                   (None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
                   (None, {**base, "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": out,
                                                            "total_tokens": n_in + out}}),
                   (None, "[DONE]")])


def main(out: Path) -> None:
    sys.path.insert(0, str(REPO / "vllm-mars"))
    from vllm_mars.agents.frontends import CliSettings, SessionPaths, get_frontend

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    try:
        for name in ("codex", "opencode") if not os.environ.get("ONLY_OPENHANDS") else ():
            work = out / f"_{name}_run"
            shutil.rmtree(work, ignore_errors=True)
            paths = SessionPaths(root=work)
            paths.home.mkdir(parents=True)
            paths.workspace.mkdir(parents=True)
            s = CliSettings(model="tiny", base_url=base, api_key="k", context_window=32768, max_output_tokens=256)
            fe = get_frontend(name)
            fe.write_config(paths, s)
            env = {**os.environ, **fe.env(paths, s), "PATH": f"{BIN}:{os.environ['PATH']}"}
            r = subprocess.run(fe.argv(str(BIN / name), "List the files, then write note.txt."), env=env,
                               cwd=paths.workspace, capture_output=True, text=True, timeout=180)
            print(name, r.returncode, r.stdout[-1500:], r.stderr[-1500:])
            sid = fe.parse(r.stdout).session_id
            # the user comes back: a second prompt in the same session (its rollout / session grows)
            calls.clear()
            calls["ids"] = 100
            r = subprocess.run(fe.argv(str(BIN / name), "Now check note.txt.", resume=sid), env=env,
                               cwd=paths.workspace, capture_output=True, text=True, timeout=180)
            print(name, "resume", sid, r.returncode, r.stdout[-1500:], r.stderr[-1500:])
        if os.environ.get("OPENHANDS_PYTHON"):  # a venv with openhands-sdk and openhands-tools 1.58.2
            work = out / "_openhands_run"
            shutil.rmtree(work, ignore_errors=True)
            (work / "ws").mkdir(parents=True)
            for i, prompt in enumerate(("List the files, then write note.txt.", "Now check note.txt.")):
                calls.clear()
                calls["ids"] = 100 * i
                r = subprocess.run([os.environ["OPENHANDS_PYTHON"], "-c", OPENHANDS, base, str(work), prompt],
                                   capture_output=True, text=True, timeout=300, cwd=work / "ws",
                                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
                                        "OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
                print("openhands", r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    finally:
        srv.shutdown()


# One conversation with the SDK's terminal and file-editor tools; a second run resumes it (same id).
OPENHANDS = """
import sys, uuid
from pathlib import Path
from openhands.sdk import LLM, Agent, Conversation, Tool
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.terminal import TerminalTool
from pydantic import SecretStr
base, work, prompt = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
llm = LLM(model="openai/tiny", base_url=base, api_key=SecretStr("k"), native_tool_calling=True,
          usage_id="agent", num_retries=0)
agent = Agent(llm=llm, tools=[Tool(name=TerminalTool.name, params={"terminal_type": "subprocess"}),
                              Tool(name=FileEditorTool.name)])
idf = work / "conversation_id"
cid = uuid.UUID(idf.read_text()) if idf.exists() else None
conv = Conversation(agent=agent, workspace=str(work / "ws"), persistence_dir=str(work / "conversations"),
                    conversation_id=cid, visualizer=None, max_iteration_per_run=10)
idf.write_text(str(conv.id))
conv.send_message(prompt)
conv.run()
print(conv.id, conv.state.execution_status)
"""


if __name__ == "__main__":
    main(Path(sys.argv[1]))
