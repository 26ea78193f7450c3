"""The MARS preview's ``mas_task_v1`` JSONL tasks, read as live-agent tasks.

A task has no recorded turns: the model chooses its actions (one JSON object per round) and the
driver runs the tools. The loader follows the preview's rules (one JSON object per non-blank line,
``schema == "mas_task_v1"``, ``payload`` an object, non-empty file) and checks the fields it
consumes (``workspace_init`` paths relative and inside the workspace, ``prefill_tokens`` > 0);
every error names ``path:line`` and the field. :func:`parse_action` turns model text into an
:class:`Action` or a :class:`ParseFailure` (what a random-weight model produces), never raising.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from vllm_mars.workload.schema import MAS_TASK_V1, WorkloadError, iter_json_lines

#: Keys of ``payload`` that hold the task's text, in the order they are tried.
TEXT_KEYS = ("text", "instruction", "problem_statement", "task_description")
#: Tools a live agent may call (the preview's set, aliases included).
TOOLS = ("run_cmd", "run", "write_file", "read_file", "list_files", "list_dir", "search",
         "compile", "test", "install", "venv", "lint", "format", "typecheck")


@dataclass(frozen=True)
class WorkspaceFile:
    path: str
    content: str


@dataclass(frozen=True)
class MasTask:
    """One live-agent task."""

    line: int
    payload: dict[str, Any]
    benchmark: str = "generic"
    task_id: str | None = None
    request_id: str | None = None
    workspace_init: tuple[WorkspaceFile, ...] = ()
    #: Caller's estimate of the first prompt (admission uses it before the prompt exists).
    prefill_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def workflow_id(self) -> str:
        return self.request_id or self.task_id or f"task-{self.line}"

    def task_text(self) -> str:
        """The first non-empty text field of the payload, else the payload as JSON."""
        for k in TEXT_KEYS:
            v = self.payload.get(k)
            if isinstance(v, str) and v.strip():
                return v
        return json.dumps(self.payload, indent=2, sort_keys=True)

    def user_prompt(self) -> str:
        head = f"[TASK] benchmark={self.benchmark} task_id={self.task_id or self.request_id or '-'}"
        files = ", ".join(f.path for f in self.workspace_init)
        ws = f"\n[WORKSPACE] files: {files}" if files else ""
        return f"{head}{ws}\n[PROBLEM]\n{self.task_text()}\n"


def _check_rel_path(p: str) -> bool:
    pp = PurePosixPath(p)
    return bool(p) and not pp.is_absolute() and ".." not in pp.parts and "\\" not in p


def parse_task(obj: dict[str, Any], path: str | Path, line: int) -> MasTask:
    if obj.get("schema") != MAS_TASK_V1:
        raise WorkloadError(path, line, "schema", f"expected {MAS_TASK_V1!r}, got {obj.get('schema')!r}")
    payload = obj.get("payload")
    if not isinstance(payload, dict):
        raise WorkloadError(path, line, "payload",
                            "missing" if payload is None else f"must be an object, got {type(payload).__name__}")
    for k in ("benchmark", "task_id", "request_id"):
        if k in obj and obj[k] is not None and not isinstance(obj[k], str):
            raise WorkloadError(path, line, k, f"must be a string, got {type(obj[k]).__name__}")
    pf = obj.get("prefill_tokens")
    if pf is not None and (isinstance(pf, bool) or not isinstance(pf, int) or pf <= 0):
        raise WorkloadError(path, line, "prefill_tokens", f"must be a positive integer, got {pf!r}")
    wi = obj.get("workspace_init") or []
    if not isinstance(wi, list):
        raise WorkloadError(path, line, "workspace_init", "must be a list of {path, content}")
    files = []
    for i, f in enumerate(wi):
        if not isinstance(f, dict):
            raise WorkloadError(path, line, f"workspace_init[{i}]", "must be an object {path, content}")
        p, c = f.get("path"), f.get("content", "")
        if not isinstance(p, str) or not _check_rel_path(p):
            raise WorkloadError(path, line, f"workspace_init[{i}].path",
                                f"must be a relative path inside the workspace, got {p!r}")
        if not isinstance(c, str):
            raise WorkloadError(path, line, f"workspace_init[{i}].content", "must be a string")
        files.append(WorkspaceFile(p, c))
    known = {"schema", "payload", "benchmark", "task_id", "request_id", "prefill_tokens", "workspace_init"}
    return MasTask(line=line, payload=payload, benchmark=obj.get("benchmark") or "generic",
                   task_id=obj.get("task_id"), request_id=obj.get("request_id"),
                   workspace_init=tuple(files), prefill_tokens=pf,
                   extra={k: v for k, v in obj.items() if k not in known})


def load_tasks(path: str | Path) -> list[MasTask]:
    """All tasks of a mas_task_v1 JSONL file; ids must be unique."""
    tasks: list[MasTask] = []
    seen: dict[str, int] = {}
    for line, obj in iter_json_lines(path):
        t = parse_task(obj, path, line)
        if t.workflow_id in seen:
            raise WorkloadError(path, line, "request_id",
                                f"duplicate task id {t.workflow_id!r} (first on line {seen[t.workflow_id]})")
        seen[t.workflow_id] = line
        tasks.append(t)
    if not tasks:
        raise WorkloadError(path, None, None, "the task file has no tasks")
    return tasks


# ---------------------------------------------------------------------- model output
@dataclass(frozen=True)
class Action:
    """A parsed agent action: a tool call, or ``final`` (the task is done)."""

    kind: str                      # "tool" or "final"
    tool: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    raw: str = ""


@dataclass(frozen=True)
class ParseFailure:
    reason: str
    raw: str = ""


def first_json_object(text: str) -> str | None:
    """The first balanced top-level ``{...}`` in ``text`` (strings and escapes respected)."""
    start = text.find("{")
    while start != -1:
        depth, in_str, esc = 0, False, False
        for i in range(start, len(text)):
            ch = text[i]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i + 1]
        start = text.find("{", start + 1)
    return None


def parse_action(text: str) -> Action | ParseFailure:
    """Model text -> Action; anything else (no JSON, bad JSON, unknown tool) -> ParseFailure."""
    blob = first_json_object(text)
    if blob is None:
        return ParseFailure("no JSON object in the output", text[:200])
    try:
        obj = json.loads(blob)
    except json.JSONDecodeError as e:
        return ParseFailure(f"invalid JSON: {e.msg}", blob[:200])
    except RecursionError:
        return ParseFailure("JSON nested too deeply", blob[:200])
    if not isinstance(obj, dict):
        return ParseFailure("not a JSON object", blob[:200])
    kind = obj.get("action") or ("tool" if "tool" in obj else "final")
    if kind == "final":
        return Action("final", raw=blob)
    if kind != "tool":
        return ParseFailure(f"unknown action {kind!r} (allowed: tool, final)", blob[:200])
    tool = obj.get("tool")
    if tool not in TOOLS:
        return ParseFailure(f"unknown tool {tool!r} (allowed: {', '.join(TOOLS)})", blob[:200])
    args = {k: v for k, v in obj.items() if k not in ("action", "tool")}
    return Action("tool", tool=tool, args=args, raw=blob)
