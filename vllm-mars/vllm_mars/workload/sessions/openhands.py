"""OpenHands SDK 1.58 (a conversation directory: ``base_state.json`` and ``events/event-NNNNN-*.json``):
``stats.usage_to_metrics.*.token_usages[]`` per call (``prompt_tokens``, ``completion_tokens``
(reasoning included), ``cache_read_tokens``, ``response_id``: the k-th response with an id is its
k-th usage); events with ``kind``,
``timestamp`` (ISO), ``ActionEvent`` (``tool_name``, ``tool_call_id``, ``llm_response_id``),
``ObservationEvent`` / ``AgentErrorEvent`` (``tool_call_id``), ``MessageEvent`` (``source``
``user``). OpenHands sub-agents are separate conversations: each converts as a root.

Read from real logs of the pinned version; tests/data/sessions/ has captured samples.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_mars.workload.schema import Workflow, WorkloadError, load_json
from vllm_mars.workload.sessions.build import (
    DEFAULT_MAX_TOOL_S,
    Call,
    Session,
    build_workflows,
    iso_ts,
    json_object,
    token_count,
)

_EVENT_FILE = re.compile(r"^event-(\d{5,})-[0-9a-fA-F-]{8,}\.json$")


def read_openhands_conversation(d: str | Path) -> Session:
    """One OpenHands SDK conversation directory as a session."""
    d = Path(d)
    base = d / "base_state.json"
    if not base.is_file():
        raise FileNotFoundError(f"{d}: no base_state.json (not an OpenHands conversation directory)")
    state = load_json(base.read_text(encoding="utf-8"), base)
    if not isinstance(state, dict):
        raise WorkloadError(base, None, None, "must be a JSON object")
    usages: dict[str, list[dict]] = {}  # response id -> its usages in order (ids can repeat)
    ordered: list[dict] = []
    metrics = json_object(json_object(state.get("stats"), base, None, "stats").get("usage_to_metrics"), base, None,
                   "stats.usage_to_metrics")
    for uid, m in metrics.items():
        for i, u in enumerate(json_object(m, base, None, f"stats.usage_to_metrics.{uid}").get("token_usages") or []):
            u = json_object(u, base, None, f"stats.usage_to_metrics.{uid}.token_usages[{i}]")
            ordered.append(u)
            if u.get("response_id"):
                usages.setdefault(str(u["response_id"]), []).append(u)
    files = sorted((f for f in (d / "events").glob("event-*.json") if _EVENT_FILE.match(f.name)),
                   key=lambda f: int(_EVENT_FILE.match(f.name).group(1)))
    calls: list[Call] = []
    by_tool_call: dict[str, list[Any]] = {}
    user_ts, start = None, None
    call: Call | None = None
    last_rid = None
    for f in files:
        e = load_json(f.read_text(encoding="utf-8"), f)
        if not isinstance(e, dict):
            raise WorkloadError(f, None, None, "must be a JSON object")
        ts = iso_ts(e.get("timestamp"), f, None, "timestamp")
        start = ts if start is None else min(start, ts)
        kind = e.get("kind")
        rid = e.get("llm_response_id")
        if kind in ("ActionEvent", "MessageEvent") and e.get("source") == "agent" and rid:
            if str(rid) != last_rid:  # a new response (its parallel tool calls share the id)
                last_rid = str(rid)
                queue = usages.get(last_rid) or [{}]
                u = queue.pop(0) if len(queue) > 1 else queue[0]
                call = Call(token_count(u.get("prompt_tokens"), f, None, "prompt_tokens"),
                            token_count(u.get("completion_tokens"), f, None, "completion_tokens"), ts,
                            token_count(u.get("cache_read_tokens"), f, None, "cache_read_tokens"), [], user_ts)
                calls.append(call)
                user_ts = None
            if kind == "ActionEvent" and call is not None:
                rec = [str(e.get("tool_name") or "tool"), ts, None]
                call.tools.append(rec)
                if e.get("tool_call_id") is not None:
                    by_tool_call[str(e["tool_call_id"])] = rec
        elif kind in ("ObservationEvent", "AgentErrorEvent", "UserRejectObservation") and e.get("tool_call_id"):
            rec = by_tool_call.get(str(e["tool_call_id"]))
            if rec is not None:
                rec[2] = ts
        elif kind == "MessageEvent" and e.get("source") == "user":
            last_rid = None
            if calls:
                user_ts = ts
    if not calls and ordered:  # no event names its response: the usages in order
        calls = [Call(token_count(u.get("prompt_tokens"), base, None, "prompt_tokens"),
                      token_count(u.get("completion_tokens"), base, None, "completion_tokens"), 0.0) for u in ordered]
    for c in calls:
        if c.input_tokens == 0:
            raise WorkloadError(base, None, "stats.usage_to_metrics",
                                "a call of the events has no token usage recorded (prompt_tokens)")
    sid = str(state.get("id") or d.name)
    return Session(sid=sid, start_ts=start or 0.0, calls=calls, source=f"openhands:{d.name}")


def openhands_dirs(src: str | Path) -> Iterator[Path]:
    src = Path(src)
    if (src / "base_state.json").is_file():
        yield src
        return
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such OpenHands conversation directory")
    found = False
    for d in sorted(p for p in src.iterdir() if (p / "base_state.json").is_file()):
        found = True
        yield d
    if not found:
        raise FileNotFoundError(f"{src}: no conversation directories (each has a base_state.json)")


def convert_openhands(src: str | Path, scale: float = 1.0,
                      max_tool_s: float = DEFAULT_MAX_TOOL_S) -> list[Workflow]:
    """Every OpenHands conversation directory under ``src`` (or ``src`` itself) as workflows."""
    return build_workflows([read_openhands_conversation(d) for d in openhands_dirs(src)], scale, max_tool_s)
