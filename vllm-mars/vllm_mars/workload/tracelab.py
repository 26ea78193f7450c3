"""Converter for TraceLab's per-round CSV (uw-syfi/TraceLab replay / csv_export format).

Columns (header required, any order, extra columns ignored)::

    session_id (or id), arrival_time, round_idx, prefix_len, input_len, output_len, tool_wait_after_ms

``prefix_len`` is the context carried over (cached) and ``input_len`` the newly appended tokens,
so a round's prompt is ``prefix_len + input_len``. One session becomes one root workflow:

* round 0: a keyed prefix segment of ``prefix_len`` tokens (key ``tracelab:prefix`` shared by
  all sessions when ``shared_first_prefix``, as a provider-cached system prompt is; otherwise
  unique) plus ``input_len`` task tokens;
* round k: ``append_tokens`` makes the prompt as long as the trace's (scaled)
  ``prefix_len + input_len``, given the previous prompt and output (clamped at 0);
* ``tool_wait_after_ms`` -> ``tool_s`` (ignored on the last round); ``arrival_time`` (seconds)
  -> ``arrival_s`` relative to the earliest session.

Errors name the file, the line and the column.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from pydantic import ValidationError

from vllm_mars.workload.schema import Segment, Turn, Workflow, WorkloadError, error_from_validation

REQUIRED = ("arrival_time", "round_idx", "prefix_len", "input_len", "output_len", "tool_wait_after_ms")
ID_COLUMNS = ("session_id", "id")


def _num(path: Path, line: int, col: str, raw: str | None, kind: type, minimum: float = 0):
    if raw is None or raw.strip() == "":
        raise WorkloadError(path, line, col, "missing value")
    try:
        f = float(raw)
    except ValueError:
        raise WorkloadError(path, line, col, f"expected a number, got {raw[:40]!r}") from None
    if not math.isfinite(f) or abs(f) > 1e15:
        raise WorkloadError(path, line, col, f"expected a finite number, got {raw[:40]!r}")
    if kind is int and f != int(f):
        raise WorkloadError(path, line, col, f"expected an integer, got {raw!r}")
    v = int(f) if kind is int else f
    if v < minimum:
        raise WorkloadError(path, line, col, f"must be >= {minimum}, got {raw!r}")
    return v


def convert_csv(path: str | Path, scale: float = 1.0, shared_first_prefix: bool = True) -> list[Workflow]:
    """Every session of a TraceLab CSV as a root workflow, in order of first appearance."""
    path = Path(path)
    try:
        return _convert_csv(path, scale, shared_first_prefix)
    except UnicodeDecodeError as e:
        raise WorkloadError(path, None, None, f"invalid UTF-8 at byte {e.start} of a block") from None
    except ValidationError as e:
        raise error_from_validation(path, None, e) from None


def _convert_csv(path: Path, scale: float, shared_first_prefix: bool) -> list[Workflow]:
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such TraceLab CSV")
    sessions: dict[str, list[tuple[int, int, dict]]] = {}
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        idcol = next((c for c in ID_COLUMNS if c in header), None)
        missing = [c for c in REQUIRED if c not in header] + ([] if idcol else ["session_id"])
        if missing:
            raise WorkloadError(path, 1, ",".join(missing),
                                f"missing column(s); the header has {header}, required: "
                                f"session_id (or id), {', '.join(REQUIRED)}")
        for row in reader:
            line = reader.line_num
            sid = (row.get(idcol) or "").strip()
            if not sid:
                raise WorkloadError(path, line, idcol, "missing value")
            rec = {
                "arrival": _num(path, line, "arrival_time", row.get("arrival_time"), float),
                "prefix": _num(path, line, "prefix_len", row.get("prefix_len"), int),
                "input": _num(path, line, "input_len", row.get("input_len"), int),
                "output": _num(path, line, "output_len", row.get("output_len"), int, 1),
                "tool_s": _num(path, line, "tool_wait_after_ms", row.get("tool_wait_after_ms"), float) / 1000.0,
            }
            rnd = _num(path, line, "round_idx", row.get("round_idx"), int)
            rows = sessions.setdefault(sid, [])
            if any(r == rnd for r, _, _ in rows):
                raise WorkloadError(path, line, "round_idx", f"duplicate round {rnd} of session {sid!r}")
            rows.append((rnd, line, rec))
    if not sessions:
        raise WorkloadError(path, None, None, "no data rows")

    t0 = min(rec["arrival"] for rows in sessions.values() for _, _, rec in rows)

    def sc(n: int, minimum: int = 0) -> int:
        return max(minimum, round(n / scale))

    out = []
    for sid, rows in sessions.items():
        rows.sort(key=lambda r: r[0])
        first = rows[0][2]
        prefix_n, task_n = sc(first["prefix"]), sc(first["input"])
        if prefix_n + task_n == 0:
            task_n = 1
        prefix = [Segment(key="tracelab:prefix" if shared_first_prefix else None, tokens=prefix_n)] if prefix_n else []
        prompt = prefix_n + task_n
        turns: list[Turn] = []
        for k, (_, _, rec) in enumerate(rows):
            append = 0
            if k:
                target = sc(rec["prefix"] + rec["input"])
                append = max(0, target - prompt - turns[-1].output_tokens)
                prompt += turns[-1].output_tokens + append
            last = k + 1 == len(rows)
            turns.append(Turn(append_tokens=append, output_tokens=sc(rec["output"], 1),
                              tool_s=0.0 if last else round(rec["tool_s"], 3)))
        out.append(Workflow(workflow_id=f"tracelab-{sid}", arrival_s=round(first["arrival"] - t0, 6),
                            prefix=prefix, prompt_tokens=task_n, turns=turns,
                            source=f"tracelab:{path.name}", meta={"session_id": sid, "scale": scale}))
    return out
