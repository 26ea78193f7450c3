"""The one builder of the session converters: a frontend's recorded calls (:class:`Call`) of a
session (:class:`Session`) as a workflow, sub-agent sessions as children (the rules are in
:mod:`vllm_mars.workload.sessions`), and the checked field readers the per-frontend readers share."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vllm_mars.workload.schema import (
    MAX_TOOL_S,
    Child,
    Compact,
    Turn,
    Workflow,
    WorkloadError,
    error_from_validation,
)

#: Default cap of a tool or user gap, seconds (as the weka converter's).
DEFAULT_MAX_TOOL_S = 300.0


@dataclass
class Call:
    """One LLM call of a session, as the frontend recorded it."""

    input_tokens: int
    output_tokens: int
    end_ts: float
    cached_tokens: int | None = None
    #: (tool name, start ts, end ts or None) of the tool calls this call made
    tools: list[list[Any]] = field(default_factory=list)
    #: when a new user message arrived before this call (None: the previous tool's output led to it)
    user_ts: float | None = None


@dataclass
class Session:
    """One session: its calls and where it came from."""

    sid: str
    start_ts: float
    calls: list[Call]
    source: str
    parent: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _check(scale: float, max_tool_s: float) -> None:
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if not (math.isfinite(max_tool_s) and 0 <= max_tool_s <= MAX_TOOL_S):
        raise ValueError(f"max_tool_s must be in [0, {MAX_TOOL_S:g}], got {max_tool_s}")


def build_workflow(s: Session, scale: float = 1.0, max_tool_s: float = DEFAULT_MAX_TOOL_S,
                   arrival_s: float | None = None, children: Iterable[Child] = ()) -> Workflow:
    """A session's calls as one workflow (see :mod:`vllm_mars.workload.sessions`)."""
    def sc(n: float, minimum: int = 0) -> int:
        return max(minimum, round(n / scale))

    turns: list[Turn] = []
    prompt = 0
    compactions = 0
    for k, c in enumerate(s.calls):
        target, out = sc(c.input_tokens, 1), sc(c.output_tokens, 1)
        compact, append = None, 0
        if k:
            before = prompt + turns[-1].output_tokens
            if target < before:
                keep = min(sc(c.cached_tokens or 0), before, target)
                compact = Compact(keep_tokens=keep, summary_tokens=target - keep)
                compactions += 1
            else:
                append = target - before
        prompt = target
        turns.append(Turn(append_tokens=append, output_tokens=out, compact=compact))
    for k, c in enumerate(s.calls[:-1]):
        spans = [(t[1], t[2]) for t in c.tools if t[1] is not None and t[2] is not None]
        tool = c.tools[0][0] if c.tools else None
        begin = min((b for b, _ in spans), default=c.end_ts)
        end = max((e for _, e in spans), default=begin)
        user = s.calls[k + 1].user_ts
        if user is not None:  # the user came back after the tools (or the answer): their gap counts
            end, tool = max(end, user), tool or "user"
        gap = end - begin
        turns[k] = turns[k].model_copy(update={"tool": tool, "tool_s": round(min(max(gap, 0.0), max_tool_s), 3)})
    return Workflow(workflow_id=s.sid, arrival_s=arrival_s, prompt_tokens=sc(s.calls[0].input_tokens, 1),
                    turns=turns, children=list(children), source=s.source,
                    meta={**s.meta, "compactions": compactions, "scale": scale})


def build_workflows(sessions: list[Session], scale: float = 1.0,
                    max_tool_s: float = DEFAULT_MAX_TOOL_S) -> list[Workflow]:
    """Root workflows (sub-agent sessions as children of their parent), by start time."""
    _check(scale, max_tool_s)
    sessions = [s for s in sessions if s.calls]
    by_id = {s.sid: s for s in sessions}
    kids: dict[str, list[Session]] = {}
    for s in sessions:
        if s.parent in by_id and s.parent != s.sid:
            kids.setdefault(s.parent, []).append(s)
    roots = sorted((s for s in sessions if s.parent not in by_id or s.parent == s.sid),
                   key=lambda s: (s.start_ts, s.sid))
    t0 = min((s.start_ts for s in roots), default=0.0)

    def build(s: Session, arrival: float | None, depth: int) -> Workflow:
        children, waited = [], {}
        for c in sorted(kids.get(s.sid, []), key=lambda c: (c.start_ts, c.sid)):
            if depth > 32:
                break
            # the call whose tool call ran the sub-agent (the store may stamp the child's start a
            # little before the tool's), else the last call that ended before the child started
            ran = [k for k, call in enumerate(s.calls) for t in call.tools
                   if t[1] is not None and t[1] - 1.0 <= c.start_ts <= (t[2] if t[2] is not None else math.inf)]
            after = ran[-1] if ran else max([k for k, call in enumerate(s.calls) if call.end_ts <= c.start_ts],
                                            default=0)
            children.append(Child(after_turn=after, parent_waits=True, workflow=build(c, None, depth + 1)))
            waited[after] = max(waited.get(after, 0.0), c.calls[-1].end_ts - c.start_ts)
        wf = build_workflow(s, scale, max_tool_s, arrival, children)
        if waited:  # the tool that ran a waited sub-agent: its own time is what the sub-agent did not cover
            turns = [t.model_copy(update={"tool_s": round(max(0.0, t.tool_s - waited[k]), 3)}) if k in waited
                     and k < len(wf.turns) - 1 else t for k, t in enumerate(wf.turns)]
            wf = wf.model_copy(update={"turns": turns})
        return wf

    out = []
    for s in roots:
        try:
            out.append(build(s, round(s.start_ts - t0, 3), 0))
        except ValidationError as e:
            raise error_from_validation(s.source.split(":", 1)[-1], None, e) from None
    return out


def iso_ts(ts: Any, path: Path, line: int | None, where: str) -> float:
    if not isinstance(ts, str):
        raise WorkloadError(path, line, where, f"must be an ISO timestamp, got {type(ts).__name__}")
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise WorkloadError(path, line, where, f"not an ISO timestamp: {ts[:40]!r}") from None


def token_count(v: Any, path: Path, line: int | None, where: str) -> int:
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1 << 40:
        raise WorkloadError(path, line, where, f"must be a token count >= 0, got {str(v)[:40]!r}")
    return int(v)


def json_object(v: Any, path: Path, line: int | None, where: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise WorkloadError(path, line, where, f"must be an object, got {type(v).__name__}")
    return v


def find_key(obj: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in a JSON value (iterative)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            if o.get(key) is not None:
                return o[key]
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)
    return None
