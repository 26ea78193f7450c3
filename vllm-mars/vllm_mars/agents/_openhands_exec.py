"""One OpenHands SDK conversation, non-interactive: what ``mars agents run --frontend openhands`` runs.

Runs with the OpenHands venv's Python (>= 3.12, ``openhands-sdk`` + ``openhands-tools``, installed
by scripts/setup_agents.sh; it cannot share vLLM's venv), so it imports nothing from vllm_mars.
Usage: ``python _openhands_exec.py --config FILE --workspace DIR [--resume ID] -- PROMPT``.
The agent has the terminal and file-editor tools (and the SDK's own finish/think), calls the
OpenAI-compatible server in FILE with native tool calling, and works in DIR. It prints JSON lines
on stdout: ``conversation`` (its id), ``action`` per tool call (the tool's name), ``message`` (the
agent's text), ``usage`` and ``done`` (the execution status: finished, stuck, error ...). Exit code
0 when the conversation finished.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="_openhands_exec.py")
    ap.add_argument("--config", required=True)
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("prompt")
    args = ap.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet
    os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
    from openhands.sdk import LLM, Agent, Conversation, Tool
    from openhands.sdk.event import ActionEvent, MessageEvent
    from openhands.tools.file_editor import FileEditorTool
    from openhands.tools.terminal import TerminalTool
    from pydantic import SecretStr

    llm = LLM(model=f"openai/{cfg['model']}", base_url=cfg["base_url"], api_key=SecretStr(cfg["api_key"]),
              native_tool_calling=True, usage_id="agent", num_retries=0, drop_params=True,
              max_output_tokens=cfg.get("max_output_tokens"), log_completions=False,
              # the SDK's default 300 s per call failed every OpenHands session of a loaded run (admission
              # waits and long prefills count): the session timeout bounds the conversation instead
              timeout=int(cfg.get("timeout_s", 3600)), stream_idle_timeout=float(cfg.get("timeout_s", 3600)))
    agent = Agent(llm=llm, tools=[Tool(name=TerminalTool.name, params={"terminal_type": "subprocess"}),
                                  Tool(name=FileEditorTool.name)])

    def on_event(e: object) -> None:
        if isinstance(e, ActionEvent):
            _emit({"type": "action", "tool": getattr(e, "tool_name", None)})
        elif isinstance(e, MessageEvent) and getattr(e, "source", None) == "agent":
            parts = getattr(e.llm_message, "content", None) or []
            _emit({"type": "message", "text": "".join(getattr(p, "text", "") for p in parts)[-500:]})

    conv = Conversation(agent=agent, workspace=args.workspace, persistence_dir=cfg.get("persistence_dir"),
                        conversation_id=uuid.UUID(args.resume) if args.resume else None, callbacks=[on_event],
                        max_iteration_per_run=int(cfg.get("max_iterations", 30)), visualizer=None,
                        delete_on_close=False)
    _emit({"type": "conversation", "id": str(conv.id)})
    status = "error"
    try:
        conv.send_message(args.prompt)
        conv.run()
        status = str(getattr(conv.state.execution_status, "value", conv.state.execution_status))
    except Exception as e:  # noqa: BLE001 (reported as the conversation's error)
        _emit({"type": "error", "message": f"{type(e).__name__}: {e}"[:500]})
    finally:
        try:
            m = llm.metrics.accumulated_token_usage
            _emit({"type": "usage", "input_tokens": getattr(m, "prompt_tokens", 0),
                   "output_tokens": getattr(m, "completion_tokens", 0),
                   "cached_tokens": getattr(m, "cache_read_tokens", 0)})
        except Exception:  # noqa: BLE001,S110 (usage is optional)
            pass
        _emit({"type": "done", "status": status})
    return 0 if status == "finished" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
