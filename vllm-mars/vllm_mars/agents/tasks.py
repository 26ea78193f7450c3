"""Task files for ``mars agents run``: the preview's ``mas_task_v1`` JSONL, or plain prompts.

* ``mas_task_v1`` (JSONL, sniffed by its ``schema``): one session per task; the prompt is the task
  text (``payload.text`` / ``instruction`` / ``problem_statement`` / ``task_description``), the
  ``workspace_init`` files are written into the session's workspace first; the prompt starts with
  ``[TASK] task_id=ID``; ``payload.check`` (a shell command) decides afterwards whether the session
  solved its task (exit 0 in the workspace).
* ``.json``: a list; each item is a prompt (one session) or a list of prompts (one session: the
  first starts it, each next one resumes it, as ``codex exec resume`` / ``opencode run --session``).
* anything else: plain text, one prompt (one session) per non-blank line; ``#`` lines are comments.

Errors name the file, the line or item, and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vllm_mars.workload.mas_task import WorkspaceFile, load_tasks
from vllm_mars.workload.schema import MAS_TASK_V1, WorkloadError, sniff_schema


@dataclass(frozen=True)
class AgentTask:
    """One session: its prompts (the first starts it, the rest resume it) and workspace files."""

    task_id: str
    prompts: tuple[str, ...]
    files: tuple[WorkspaceFile, ...] = ()
    #: a shell command run in the workspace after the session: exit 0 = solved (``payload.check``)
    check: str | None = None


def _prompt(p: object, path: Path, where: str) -> str:
    if not isinstance(p, str) or not p.strip():
        raise WorkloadError(path, None, where, f"must be a non-empty string, got {p!r}"[:200])
    return p


def load_agent_tasks(path: str | Path) -> list[AgentTask]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task file")
    if path.suffix == ".jsonl" or (path.suffix != ".json" and path.read_text(errors="replace").lstrip()
                                   .startswith("{")):
        if sniff_schema(path) != MAS_TASK_V1:
            raise WorkloadError(path, None, "schema", f"JSONL task files must be {MAS_TASK_V1!r}")
        out = []
        for t in load_tasks(path):
            files = ", ".join(f.path for f in t.workspace_init)
            text = t.task_text()
            # the task id line: the scripted model (mars serve --scripted) finds its script by it
            head = f"[TASK] task_id={t.task_id or t.workflow_id}\n"
            prompt = head + (f"The workspace contains: {files}.\n\n{text}" if files else text)
            check = t.payload.get("check")
            if check is not None and (not isinstance(check, str) or not check.strip()):
                raise WorkloadError(path, t.line, "payload.check", "must be a non-empty shell command string")
            out.append(AgentTask(t.workflow_id, (prompt,), t.workspace_init, check))
        return out
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise WorkloadError(path, e.lineno, None, f"invalid JSON: {e.msg}") from None
        if not isinstance(data, list) or not data:
            raise WorkloadError(path, None, None, "expected a non-empty JSON list of prompts")
        out = []
        for i, item in enumerate(data):
            items = item if isinstance(item, list) else [item]
            if not items:
                raise WorkloadError(path, None, f"[{i}]", "an empty list of prompts")
            prompts = tuple(_prompt(p, path, f"[{i}][{j}]" if isinstance(item, list) else f"[{i}]")
                            for j, p in enumerate(items))
            out.append(AgentTask(f"task-{i}", prompts))
        return out
    lines = [(n, s.strip()) for n, s in enumerate(path.read_text().splitlines(), 1)]
    out = [AgentTask(f"task-{n}", (s,)) for n, s in lines if s and not s.startswith("#")]
    if not out:
        raise WorkloadError(path, None, None, "the task file has no prompts")
    return out
