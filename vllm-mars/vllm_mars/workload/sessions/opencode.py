"""OpenCode 1.18 (``$XDG_DATA_HOME/opencode/opencode.db``, SQLite; before 1.x the same objects as
JSON files under ``storage/``): ``session`` (``id``, ``parent_id``, ``time_created``),
``message`` (assistant: ``tokens.input`` + ``tokens.cache.read`` + ``tokens.cache.write`` is the
prompt, ``tokens.output`` + ``tokens.reasoning`` the output, ``time.created``/``completed``;
user: ``time.created``), ``part`` (``type`` ``tool``: ``tool``, ``state.time.start``/``end``).

Read from real logs of the pinned version; tests/data/sessions/ has captured samples.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from vllm_mars.workload.schema import Workflow, WorkloadError, load_json
from vllm_mars.workload.sessions.build import (
    DEFAULT_MAX_TOOL_S,
    Call,
    Session,
    build_workflows,
    json_object,
    token_count,
)


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
            st = json_object(p.get("state"), where, None, f"part[{p.get('id')}].state")
            t = json_object(st.get("time"), where, None, f"part[{p.get('id')}].state.time")
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
        created = json_object(s.get("time"), where, None, f"session[{sid}].time").get("created")
        msgs = sorted(per_session.get(sid, []),
                      key=lambda m: (json_object(m.get("time"), where, None, f"message[{m.get('id')}].time").get("created") or 0,
                                     str(m.get("id"))))
        calls: list[Call] = []
        user_ts = None
        for m in msgs:
            at = f"message[{m.get('id')}]"
            t = json_object(m.get("time"), where, None, f"{at}.time")
            if m.get("role") == "user":
                user_ts = (t.get("created") or 0) / 1000 if calls else None
                continue
            if m.get("role") != "assistant":
                continue
            tok = json_object(m.get("tokens"), where, None, f"{at}.tokens")
            cache = json_object(tok.get("cache"), where, None, f"{at}.tokens.cache")
            read = token_count(cache.get("read"), where, None, f"{at}.tokens.cache.read")
            inp = token_count(tok.get("input"), where, None, f"{at}.tokens.input") + read + \
                token_count(cache.get("write"), where, None, f"{at}.tokens.cache.write")
            outp = token_count(tok.get("output"), where, None, f"{at}.tokens.output") + \
                token_count(tok.get("reasoning"), where, None, f"{at}.tokens.reasoning")
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
