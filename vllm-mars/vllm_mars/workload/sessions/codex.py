"""Codex 0.171 (``$CODEX_HOME/sessions/YYYY/MM/DD/rollout-*.jsonl``): one JSON object per line with
``timestamp``, ``type`` and ``payload``; ``session_meta`` (``id``, ``timestamp``, a sub-agent's
``parent_thread_id`` anywhere inside), ``token_usage_record`` per call (``usage.input_tokens``,
``cached_input_tokens``, ``output_tokens``; older versions: ``event_msg`` ``token_count`` with
``info.last_token_usage``), ``response_item`` ``function_call`` / ``custom_tool_call`` (before
the usage of the call that made them) and ``function_call_output`` / ``custom_tool_call_output``
(by ``call_id``), ``event_msg`` ``task_started`` (a user turn; after the first, the user's gap).

Read from real logs of the pinned version; tests/data/sessions/ has captured samples.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm_mars.workload.schema import Workflow, WorkloadError, iter_json_lines
from vllm_mars.workload.sessions.build import (
    DEFAULT_MAX_TOOL_S,
    Call,
    Session,
    build_workflows,
    find_key,
    iso_ts,
    json_object,
    token_count,
)


def codex_home_sessions() -> Path:
    return Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex") / "sessions"


def read_codex_rollout(path: str | Path) -> Session:
    """One Codex rollout file as a session."""
    path = Path(path)
    sid, start, parent = None, None, None
    records: list[Call] = []
    counts: list[Call] = []
    last_total = None
    pending: list[list[Any]] = []
    by_call_id: dict[str, list[Any]] = {}
    user_ts: float | None = None
    seen_user = False
    for line, obj in iter_json_lines(path):
        kind = obj.get("type")
        p = json_object(obj.get("payload"), path, line, "payload")
        if kind == "session_meta":
            sid = str(p.get("id") or p.get("session_id") or "")
            start = iso_ts(p.get("timestamp") or obj.get("timestamp"), path, line, "payload.timestamp")
            parent = find_key(p.get("source"), "parent_thread_id") or p.get("parent_thread_id")
            continue
        if kind not in ("response_item", "event_msg", "token_usage_record"):
            continue
        ts = iso_ts(obj.get("timestamp"), path, line, "timestamp")
        pt = p.get("type")
        if kind == "token_usage_record":
            u = json_object(p.get("usage"), path, line, "payload.usage")
            records.append(Call(token_count(u.get("input_tokens"), path, line, "payload.usage.input_tokens"),
                                token_count(u.get("output_tokens"), path, line, "payload.usage.output_tokens"),
                                ts, token_count(u.get("cached_input_tokens"), path, line, "payload.usage.cached_input_tokens"),
                                pending, user_ts))
            pending, user_ts = [], None
        elif kind == "event_msg" and pt == "token_count":
            info = json_object(p.get("info"), path, line, "payload.info")
            u = json_object(info.get("last_token_usage"), path, line, "payload.info.last_token_usage")
            total = json.dumps(info.get("total_token_usage"), sort_keys=True)
            if u and total != last_total:  # the same count is re-sent with rate-limit updates
                last_total = total
                counts.append(Call(token_count(u.get("input_tokens"), path, line, "payload.info.last_token_usage.input_tokens"),
                                   token_count(u.get("output_tokens"), path, line, "payload.info.last_token_usage.output_tokens"),
                                   ts, token_count(u.get("cached_input_tokens"), path, line, "cached_input_tokens")))
        elif kind == "event_msg" and pt == "task_started":  # a user turn starts (the first: the session)
            if seen_user:
                user_ts = ts
            seen_user = True
        elif kind == "response_item" and pt in ("function_call", "custom_tool_call", "local_shell_call"):
            rec = [str(p.get("name") or pt), ts, None]
            pending.append(rec)
            if p.get("call_id") is not None:
                by_call_id[str(p["call_id"])] = rec
        elif kind == "response_item" and pt in ("function_call_output", "custom_tool_call_output"):
            rec = by_call_id.get(str(p.get("call_id")))
            if rec is not None:
                rec[2] = ts
    if sid is None or start is None:
        raise WorkloadError(path, None, "session_meta", "missing: not a Codex rollout file")
    calls = records
    if not records:  # older rollouts: the token_count events, tools by time
        calls = counts
    return Session(sid=sid, start_ts=start, calls=calls, source=f"codex:{path.name}",
                   parent=str(parent) if parent else None)


def codex_files(src: str | Path) -> list[Path]:
    src = Path(src)
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such Codex rollout file or sessions directory")
    files = sorted(src.rglob("rollout-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{src}: no rollout-*.jsonl files (Codex keeps them in $CODEX_HOME/sessions)")
    return files


def convert_codex(src: str | Path | None = None, scale: float = 1.0,
                  max_tool_s: float = DEFAULT_MAX_TOOL_S) -> list[Workflow]:
    """Every Codex rollout under ``src`` (default ``$CODEX_HOME/sessions``) as workflows."""
    sessions = [read_codex_rollout(f) for f in codex_files(src or codex_home_sessions())]
    return build_workflows(sessions, scale, max_tool_s)
