"""Live-agent runs of the MARS preview's ``mas_task_v1`` tasks: the model chooses the tools.

Each task is a root workflow. Round k appends ``[ROUND k]`` to an append-only text context, asks
the model for one JSON action (no ``ignore_eos``: the model decides the length, up to
``max_tokens``), parses it with :func:`vllm_mars.workload.mas_task.parse_action`, runs the tool in
the task's workspace and appends the result. A parse failure is an event (``agent_parse_failure``)
and a ``[FORMAT_ERROR]`` line in the context, never a crash: with the tiny random model every round
is one, which is what a CPU run of this path shows. ``run_cmd``-style tools execute only with the
real tool plane (``--tools real``, sandboxed); with simulated tools they are recorded, not run.
File tools (read/write/list) act on the task's workspace, paths confined to it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm_mars.workload.mas_task import Action, MasTask, ParseFailure, load_tasks, parse_action

SYSTEM_PROMPT = (
    "You are a software engineering agent working in a sandboxed workspace. Each round, output exactly "
    "ONE JSON object and nothing else: a tool call such as "
    '{"action": "tool", "tool": "run_cmd", "cmd": "pytest -q"}, '
    '{"action": "tool", "tool": "read_file", "path": "README.md"}, '
    '{"action": "tool", "tool": "write_file", "path": "fix.py", "content": "..."}, '
    '{"action": "tool", "tool": "list_files"}, or {"action": "final"} when the task is done.'
)
FILE_TOOLS = ("read_file", "write_file", "list_files", "list_dir")


@dataclass(frozen=True)
class LiveOptions:
    """Knobs of a live-agent run (the preview's defaults, scaled for CPU)."""

    #: Rounds per task (the preview: 8).
    max_rounds: int = 8
    #: Output tokens per round; the model may stop earlier.
    max_tokens: int = 256
    #: Characters of tool output appended to the context.
    tool_output_chars: int = 2000


@dataclass(frozen=True)
class LivePlan:
    """A mas_task_v1 task as the driver's plan: a root workflow whose turns the model decides."""

    workflow_id: str
    task: MasTask
    initial_ids: list[int]
    root_id: str = ""
    parent_id: str | None = None
    arrival_s: float | None = None
    turns: tuple = ()
    children: list = field(default_factory=list)

    @property
    def prefill_estimate(self) -> int:
        return self.task.prefill_tokens or len(self.initial_ids)

    @property
    def num_turns(self) -> int:
        return 0  # unknown: the model decides

    def final_prompt_tokens(self) -> int:
        return len(self.initial_ids)

    def walk(self):
        yield self


def load_live_plans(path: str | Path, tokenizer: Any) -> list[LivePlan]:
    """mas_task_v1 JSONL -> live plans (loader errors name path:line:field)."""
    plans = []
    for task in load_tasks(path):
        wid = task.workflow_id
        ids = tokenizer.encode(SYSTEM_PROMPT + "\n\n" + task.user_prompt(), add_special_tokens=False)
        plans.append(LivePlan(wid, task, ids, root_id=wid))
    return plans


def _confined(ws: Path, rel: Any) -> Path | None:
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute():
        return None
    p = (ws / rel).resolve()
    return p if p == ws.resolve() or ws.resolve() in p.parents else None


def _file_tool(ws: Path, action: Action) -> str:
    a = action.args
    if action.tool in ("list_files", "list_dir"):
        names = sorted(str(p.relative_to(ws)) for p in ws.rglob("*") if p.is_file())
        return "\n".join(names[:200]) or "(empty workspace)"
    path = _confined(ws, a.get("path"))
    if path is None:
        return f"error: path {a.get('path')!r} must be relative and inside the workspace"
    if action.tool == "read_file":
        return path.read_text(errors="replace") if path.is_file() else f"error: no file {a.get('path')!r}"
    content = a.get("content")
    if not isinstance(content, str):
        return "error: write_file needs a string 'content'"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    return f"wrote {len(content)} characters to {a.get('path')}"


async def run_live(replay: Any, plan: LivePlan, tokenizer: Any, opts: LiveOptions) -> int:
    """Run one live task through ``replay``'s backend, tools and event log; returns its context length."""
    wid, task = plan.workflow_id, plan.task
    ev = replay.events
    ws = getattr(replay.tools, "workspace", None)
    ws = ws(wid) if ws is not None else replay.out / "workspaces" / wid
    ws.mkdir(parents=True, exist_ok=True)
    for f in task.workspace_init:
        dest = _confined(ws, f.path)
        if dest is not None:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(f.content)
    prompt = list(plan.initial_ids)
    max_len = replay.plan.max_model_len
    failures = rounds = 0
    outcome = "max_rounds"
    for k in range(opts.max_rounds):
        prompt += tokenizer.encode(f"\n\n[ROUND {k + 1}] Now output exactly ONE JSON object for the next action.\n",
                                   add_special_tokens=False)
        if len(prompt) + opts.max_tokens > max_len:
            outcome = "context_full"
            break
        rid = f"{wid}:t{k}"
        extra = {"mars_workflow": wid, "mars_root": wid, "mars_turn": k,
                 "mars_last_step": k == opts.max_rounds - 1, "mars_prefill_tokens": len(prompt)}
        submit = replay.clock()
        if k:
            replay.ctrl.update_estimate(wid, len(prompt), submit)
        ev.emit("call_submit", ts=submit, workflow=wid, root=wid, turn=k, request_id=rid,
                prompt_tokens=len(prompt), max_tokens=opts.max_tokens)
        res = await asyncio.wait_for(replay.backend.generate(rid, prompt, opts.max_tokens, extra, ignore_eos=False),
                                     replay.call_timeout)
        ttft = None if res.first_token_ts is None else res.first_token_ts - submit
        if ttft is not None:
            ev.emit("call_first_token", ts=res.first_token_ts, workflow=wid, root=wid, turn=k, request_id=rid,
                    ttft_s=round(ttft, 6))
        ev.emit("call_end", ts=res.end_ts, workflow=wid, root=wid, turn=k, request_id=rid,
                prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens, output_tokens=len(res.output_ids),
                ttft_s=None if ttft is None else round(ttft, 6), latency_s=round(res.end_ts - submit, 6),
                finish_reason=res.finish_reason)
        rounds += 1
        prompt += res.output_ids
        action = parse_action(tokenizer.decode(res.output_ids, skip_special_tokens=True))
        if isinstance(action, ParseFailure):
            failures += 1
            ev.emit("agent_parse_failure", workflow=wid, root=wid, turn=k, reason=action.reason)
            result = f"[FORMAT_ERROR] {action.reason}. Output exactly one JSON object."
        elif action.kind == "final":
            outcome = "final"
            break
        elif action.tool in FILE_TOOLS:
            result = _file_tool(ws, action)
        else:
            cmd = action.args.get("cmd") or action.args.get("command")
            if not isinstance(cmd, str) or not cmd.strip():
                result = f"error: tool {action.tool!r} needs a 'cmd' string"
            else:
                out = await replay._tool(plan, k, SimpleNamespace(tool_name=action.tool, tool_cmd=cmd, tool_s=0.0))
                result = json.dumps({"rc": out.get("rc"), "stdout": out.get("stdout_tail"),
                                     "stderr": out.get("stderr_tail")}) if out.get("rc") is not None else \
                    "[simulated tool plane: command recorded, not run]"
        prompt += tokenizer.encode("\n[TOOL_RESULT]\n" + result[: opts.tool_output_chars] + "\n",
                                   add_special_tokens=False)
    ev.emit("agent_done", workflow=wid, root=wid, rounds=rounds, parse_failures=failures, outcome=outcome)
    return len(prompt)
