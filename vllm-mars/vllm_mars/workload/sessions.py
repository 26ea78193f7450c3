"""Converters for the agent frontends' own session logs: Codex rollouts, OpenCode's session store and
OpenHands conversation directories, each session a workflow (sub-agent sessions as children).

What every frontend records, per LLM call: the prompt's token count (the provider's usage), the
output's, when the call ended, and the tool calls it made with when each started and ended. From
that (:class:`Call`) one builder (:func:`build_workflow`) makes the workflow:

* turn k's ``output_tokens`` = the call's output (reasoning included); turn 0's prompt is the
  first call's input tokens, unique to the session;
* turn k's ``append_tokens`` makes its prompt as long as the recorded input: ``in_k - (in_{k-1} +
  out_{k-1})``; where the recorded input is shorter (the frontend compacted its context), turn k
  compacts (schema v2): it keeps what the provider reported cached for that call (0 when it does
  not say) and the rest of ``in_k`` is new summary;
* the tool time after turn k is the span of its tool calls (first start to last end); when the next
  call answers a new user message, it runs until that message (tool ``"user"`` if the call made no
  tool call): the user's gap is replayed as tool time; clipped to ``max_tool_s``;
* roots arrive when their session started, relative to the earliest session converted;
* a sub-agent session starts after the last parent call that ended before it started, and the
  parent waits for it (the frontends run sub-agents as blocking tool calls); that call's tool time
  excludes the sub-agent's duration (the replay runs both at once, as the weka converter does).

``scale`` divides every token count (at least 1 output token). No prefix is shared between
sessions: a log records token counts, not which tokens two sessions have in common.

Formats (read from real logs of the pinned versions; tests/data/sessions/ has captured samples):

* Codex 0.171 (``$CODEX_HOME/sessions/YYYY/MM/DD/rollout-*.jsonl``): one JSON object per line with
  ``timestamp``, ``type`` and ``payload``; ``session_meta`` (``id``, ``timestamp``, a sub-agent's
  ``parent_thread_id`` anywhere inside), ``token_usage_record`` per call (``usage.input_tokens``,
  ``cached_input_tokens``, ``output_tokens``; older versions: ``event_msg`` ``token_count`` with
  ``info.last_token_usage``), ``response_item`` ``function_call`` / ``custom_tool_call`` (before
  the usage of the call that made them) and ``function_call_output`` / ``custom_tool_call_output``
  (by ``call_id``), ``event_msg`` ``task_started`` (a user turn; after the first, the user's gap).
* OpenCode 1.18 (``$XDG_DATA_HOME/opencode/opencode.db``, SQLite; before 1.x the same objects as
  JSON files under ``storage/``): ``session`` (``id``, ``parent_id``, ``time_created``),
  ``message`` (assistant: ``tokens.input`` + ``tokens.cache.read`` + ``tokens.cache.write`` is the
  prompt, ``tokens.output`` + ``tokens.reasoning`` the output, ``time.created``/``completed``;
  user: ``time.created``), ``part`` (``type`` ``tool``: ``tool``, ``state.time.start``/``end``).
* OpenHands SDK 1.58 (a conversation directory: ``base_state.json`` and ``events/event-NNNNN-*.json``):
  ``stats.usage_to_metrics.*.token_usages[]`` per call (``prompt_tokens``, ``completion_tokens``
  (reasoning included), ``cache_read_tokens``, ``response_id``: the k-th response with an id is its
  k-th usage); events with ``kind``,
  ``timestamp`` (ISO), ``ActionEvent`` (``tool_name``, ``tool_call_id``, ``llm_response_id``),
  ``ObservationEvent`` / ``AgentErrorEvent`` (``tool_call_id``), ``MessageEvent`` (``source``
  ``user``). OpenHands sub-agents are separate conversations: each converts as a root.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
from collections.abc import Iterable, Iterator
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
    iter_json_lines,
    load_json,
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
    """A session's calls as one workflow (see the module docstring)."""
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


def _iso(ts: Any, path: Path, line: int | None, where: str) -> float:
    if not isinstance(ts, str):
        raise WorkloadError(path, line, where, f"must be an ISO timestamp, got {type(ts).__name__}")
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise WorkloadError(path, line, where, f"not an ISO timestamp: {ts[:40]!r}") from None


def _int(v: Any, path: Path, line: int | None, where: str) -> int:
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1 << 40:
        raise WorkloadError(path, line, where, f"must be a token count >= 0, got {str(v)[:40]!r}")
    return int(v)


def _obj(v: Any, path: Path, line: int | None, where: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise WorkloadError(path, line, where, f"must be an object, got {type(v).__name__}")
    return v


def _find_key(obj: Any, key: str) -> Any:
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


# ---------------------------------------------------------------------- Codex
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
        p = _obj(obj.get("payload"), path, line, "payload")
        if kind == "session_meta":
            sid = str(p.get("id") or p.get("session_id") or "")
            start = _iso(p.get("timestamp") or obj.get("timestamp"), path, line, "payload.timestamp")
            parent = _find_key(p.get("source"), "parent_thread_id") or p.get("parent_thread_id")
            continue
        if kind not in ("response_item", "event_msg", "token_usage_record"):
            continue
        ts = _iso(obj.get("timestamp"), path, line, "timestamp")
        pt = p.get("type")
        if kind == "token_usage_record":
            u = _obj(p.get("usage"), path, line, "payload.usage")
            records.append(Call(_int(u.get("input_tokens"), path, line, "payload.usage.input_tokens"),
                                _int(u.get("output_tokens"), path, line, "payload.usage.output_tokens"),
                                ts, _int(u.get("cached_input_tokens"), path, line, "payload.usage.cached_input_tokens"),
                                pending, user_ts))
            pending, user_ts = [], None
        elif kind == "event_msg" and pt == "token_count":
            info = _obj(p.get("info"), path, line, "payload.info")
            u = _obj(info.get("last_token_usage"), path, line, "payload.info.last_token_usage")
            total = json.dumps(info.get("total_token_usage"), sort_keys=True)
            if u and total != last_total:  # the same count is re-sent with rate-limit updates
                last_total = total
                counts.append(Call(_int(u.get("input_tokens"), path, line, "payload.info.last_token_usage.input_tokens"),
                                   _int(u.get("output_tokens"), path, line, "payload.info.last_token_usage.output_tokens"),
                                   ts, _int(u.get("cached_input_tokens"), path, line, "cached_input_tokens")))
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


# ---------------------------------------------------------------------- OpenCode
def opencode_data_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "opencode"


def _opencode_rows_db(db: Path) -> tuple[list[dict], list[dict], list[dict]]:
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise WorkloadError(db, None, None, f"cannot open the OpenCode database: {e}") from None
    try:
        def rows(sql: str, table: str) -> list[tuple]:
            try:
                return con.execute(sql).fetchall()
            except sqlite3.DatabaseError as e:
                raise WorkloadError(db, None, table, f"cannot read the table: {e}") from None

        def data(table: str, rid: str, text: str) -> dict:
            obj = load_json(text, f"{db}:{table}[{rid}]")
            return obj if isinstance(obj, dict) else {}

        sessions = [{"id": i, "parentID": p, "time": {"created": t}}
                    for i, p, t in rows("select id, parent_id, time_created from session", "session")]
        messages = [{**data("message", i, d), "id": i, "sessionID": s}
                    for i, s, d in rows("select id, session_id, data from message", "message")]
        parts = [{**data("part", i, d), "id": i, "messageID": m, "sessionID": s}
                 for i, m, s, d in rows("select id, message_id, session_id, data from part", "part")]
    finally:
        con.close()
    return sessions, messages, parts


def _opencode_rows_storage(storage: Path) -> tuple[list[dict], list[dict], list[dict]]:
    def objs(sub: str) -> list[dict]:
        out = []
        for f in sorted((storage / sub).rglob("*.json")):
            obj = load_json(f.read_text(encoding="utf-8"), f)
            if not isinstance(obj, dict):
                raise WorkloadError(f, None, None, f"must be a JSON object, got {type(obj).__name__}")
            out.append(obj)
        return out

    return objs("session"), objs("message"), objs("part")


def read_opencode(src: str | Path | None = None) -> list[Session]:
    """OpenCode's sessions from its data directory (``opencode.db``, or the older ``storage/``)."""
    src = Path(src or opencode_data_dir())
    if src.is_file():
        where, (sessions, messages, parts) = src, _opencode_rows_db(src)
    elif (src / "opencode.db").is_file():
        where, (sessions, messages, parts) = src / "opencode.db", _opencode_rows_db(src / "opencode.db")
    elif (src / "storage" / "session").is_dir() or (src / "session").is_dir():
        storage = src / "storage" if (src / "storage").is_dir() else src
        where, (sessions, messages, parts) = storage, _opencode_rows_storage(storage)
    else:
        raise FileNotFoundError(f"{src}: no opencode.db or storage/ (OpenCode keeps them in "
                                f"$XDG_DATA_HOME/opencode)")
    tools: dict[str, list[list[Any]]] = {}
    for p in parts:
        if p.get("type") == "tool":
            st = _obj(p.get("state"), where, None, f"part[{p.get('id')}].state")
            t = _obj(st.get("time"), where, None, f"part[{p.get('id')}].state.time")
            b, e = t.get("start"), t.get("end")
            tools.setdefault(str(p.get("messageID")), []).append(
                [str(p.get("tool") or "tool"), b / 1000 if isinstance(b, (int, float)) else None,
                 e / 1000 if isinstance(e, (int, float)) else None])
    per_session: dict[str, list[dict]] = {}
    for m in messages:
        per_session.setdefault(str(m.get("sessionID")), []).append(m)
    out = []
    for s in sessions:
        sid = str(s.get("id"))
        created = _obj(s.get("time"), where, None, f"session[{sid}].time").get("created")
        msgs = sorted(per_session.get(sid, []),
                      key=lambda m: (_obj(m.get("time"), where, None, f"message[{m.get('id')}].time").get("created") or 0,
                                     str(m.get("id"))))
        calls: list[Call] = []
        user_ts = None
        for m in msgs:
            at = f"message[{m.get('id')}]"
            t = _obj(m.get("time"), where, None, f"{at}.time")
            if m.get("role") == "user":
                user_ts = (t.get("created") or 0) / 1000 if calls else None
                continue
            if m.get("role") != "assistant":
                continue
            tok = _obj(m.get("tokens"), where, None, f"{at}.tokens")
            cache = _obj(tok.get("cache"), where, None, f"{at}.tokens.cache")
            read = _int(cache.get("read"), where, None, f"{at}.tokens.cache.read")
            inp = _int(tok.get("input"), where, None, f"{at}.tokens.input") + read + \
                _int(cache.get("write"), where, None, f"{at}.tokens.cache.write")
            outp = _int(tok.get("output"), where, None, f"{at}.tokens.output") + \
                _int(tok.get("reasoning"), where, None, f"{at}.tokens.reasoning")
            if inp == 0 and outp == 0:
                continue  # an aborted call that never reached the model
            mtools = tools.get(str(m.get("id")), [])
            # the call's answer is complete when its first tool starts (completed: after its tools ran)
            end = min([(t.get("completed") or t.get("created") or 0) / 1000,
                       *(x[1] for x in mtools if x[1] is not None)])
            calls.append(Call(inp, outp, end, read, mtools, user_ts))
            user_ts = None
        start = (created if isinstance(created, (int, float)) else 0) / 1000
        out.append(Session(sid=sid, start_ts=start, calls=calls, source=f"opencode:{where.name}",
                           parent=str(s["parentID"]) if s.get("parentID") else None))
    return out


def convert_opencode(src: str | Path | None = None, scale: float = 1.0,
                     max_tool_s: float = DEFAULT_MAX_TOOL_S) -> list[Workflow]:
    """Every OpenCode session under ``src`` (default ``$XDG_DATA_HOME/opencode``) as workflows."""
    return build_workflows(read_opencode(src), scale, max_tool_s)


# ---------------------------------------------------------------------- OpenHands
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
    metrics = _obj(_obj(state.get("stats"), base, None, "stats").get("usage_to_metrics"), base, None,
                   "stats.usage_to_metrics")
    for uid, m in metrics.items():
        for i, u in enumerate(_obj(m, base, None, f"stats.usage_to_metrics.{uid}").get("token_usages") or []):
            u = _obj(u, base, None, f"stats.usage_to_metrics.{uid}.token_usages[{i}]")
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
        ts = _iso(e.get("timestamp"), f, None, "timestamp")
        start = ts if start is None else min(start, ts)
        kind = e.get("kind")
        rid = e.get("llm_response_id")
        if kind in ("ActionEvent", "MessageEvent") and e.get("source") == "agent" and rid:
            if str(rid) != last_rid:  # a new response (its parallel tool calls share the id)
                last_rid = str(rid)
                queue = usages.get(last_rid) or [{}]
                u = queue.pop(0) if len(queue) > 1 else queue[0]
                call = Call(_int(u.get("prompt_tokens"), f, None, "prompt_tokens"),
                            _int(u.get("completion_tokens"), f, None, "completion_tokens"), ts,
                            _int(u.get("cache_read_tokens"), f, None, "cache_read_tokens"), [], user_ts)
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
        calls = [Call(_int(u.get("prompt_tokens"), base, None, "prompt_tokens"),
                      _int(u.get("completion_tokens"), base, None, "completion_tokens"), 0.0) for u in ordered]
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


CONVERTERS = {"codex": convert_codex, "opencode": convert_opencode, "openhands": convert_openhands}
