"""Converter for the agentic-coding session traces of the public ``callanjfox/kv-cache-tester`` repository (its ``traces/``; a sample ships in ``benchmark/workloads/weka_sample/``).

One trace file (one coding-agent session) becomes one root workflow:

* each non-``subagent`` request is a turn, in time order; ``out`` -> ``output_tokens``;
* the first request's ``hash_ids`` (one per 64-token block) become keyed prefix segments
  ``"<trace id>:<hash id>"``, so blocks the trace shares (e.g. the system prompt of every
  ``Explore`` sub-agent) get identical token ids and share vLLM's prefix cache; the tokens past
  the last full block are task tokens;
* turn k's ``append_tokens`` makes turn k's prompt as long as the trace's ``in`` (scaled):
  ``round(in_k / scale) - (prompt_{k-1} + output_{k-1})``, clamped at 0 where the recorded context
  shrank (counted in ``meta.context_shrinks``);
* tool time after turn k = ``t[k+1] - t[k] - api_time[k]`` (tool plus client time, as the trace
  README defines the gap), clipped to ``max_tool_s`` (longer gaps are a user away, not a tool);
  a request without ``api_time`` counts it as 0;
* a ``subagent`` entry becomes a child workflow ``"<trace id>/<agent_id>"`` started after the last
  parent turn at or before its ``t``; ``parent_waits`` when the parent's next request came after
  the sub-agent ended, and then that turn's tool time excludes the sub-agent's duration (the
  driver runs the tool and waited children concurrently and starts the next turn after both).

``scale`` divides every token count (block size too: a 64-token block becomes ``64 / scale``
tokens, at least 1); times are unchanged.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vllm_mars.workload.schema import (
    MAX_DEPTH,
    MAX_TOKENS,
    MAX_TOOL_S,
    Child,
    Segment,
    Turn,
    Workflow,
    WorkloadError,
    error_from_validation,
    load_json,
)

logger = logging.getLogger(__name__)

#: Block size of the traces' hash ids (the file's ``block_size`` field overrides it).
TRACE_BLOCK_SIZE = 64
#: Default cap of a tool gap, seconds.
DEFAULT_MAX_TOOL_S = 300.0


def _scaled(n: float, scale: float, minimum: int = 0) -> int:
    return max(minimum, round(n / scale))


def _calls(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((r for r in requests if r.get("type") != "subagent"), key=lambda r: r["t"])


def _need(r: dict[str, Any], key: str, path: Path, where: str) -> Any:
    if key not in r:
        raise WorkloadError(path, None, f"{where}.{key}", "missing")
    return r[key]


def _num(r: dict[str, Any], key: str, path: Path, where: str, default: float | None = None) -> float:
    """A finite, non-negative number field (``default`` when absent or null, if given)."""
    v = r.get(key)
    if v is None:
        if default is not None:
            return default
        raise WorkloadError(path, None, f"{where}.{key}".lstrip("."),
                            "missing" if key not in r else "must be a number, got null")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or v > 1e15:
        raise WorkloadError(path, None, f"{where}.{key}".lstrip("."),
                            f"must be a finite number >= 0, got {str(v)[:40]!r}")
    return v


def _check_requests(requests: Any, path: Path, where: str, depth: int = 0) -> None:
    """Shape and types of a session's requests (and its sub-agents'), before anything is converted."""
    if not isinstance(requests, list):
        raise WorkloadError(path, None, where, f"must be a list, got {type(requests).__name__}")
    if depth > MAX_DEPTH:
        raise WorkloadError(path, None, where, f"sub-agents nested more than {MAX_DEPTH} levels deep")
    for i, r in enumerate(requests):
        at = f"{where}[{i}]"
        if not isinstance(r, dict):
            raise WorkloadError(path, None, at, f"must be an object, got {type(r).__name__}")
        _num(r, "t", path, at)
        if r.get("type") == "subagent":
            _num(r, "duration_ms", path, at, default=0.0)
            if r.get("requests"):
                _check_requests(r["requests"], path, f"{at}.requests", depth + 1)
            continue
        for key in ("in", "out"):
            _num(r, key, path, at)
        _num(r, "api_time", path, at, default=0.0)
        hashes = r.get("hash_ids", [])
        if not isinstance(hashes, list) or len(hashes) > MAX_TOKENS:
            raise WorkloadError(path, None, f"{at}.hash_ids", "must be a list of block ids")


def _convert_session(path: Path, trace_id: str, wid: str, requests: list[dict[str, Any]],
                     block: int, scale: float, max_tool_s: float, where: str) -> Workflow:
    calls = _calls(requests)
    if not calls:
        raise WorkloadError(path, None, where, "a session without any non-subagent request")
    bt = max(1, round(block / scale))
    first = calls[0]
    hashes = _need(first, "hash_ids", path, f"{where}[0]")
    first_in = int(_need(first, "in", path, f"{where}[0]"))
    prefix = [Segment(key=f"{trace_id}:{h}", tokens=bt) for h in hashes]
    task = _scaled(max(0, first_in - block * len(hashes)), scale)
    if not prefix and task == 0:
        task = 1
    prompt = bt * len(prefix) + task

    subs = sorted((r for r in requests if r.get("type") == "subagent" and r.get("requests")),
                  key=lambda r: r["t"])
    children: list[Child] = []
    waited_s = [0.0] * len(calls)   # longest waited sub-agent after each turn
    for s in subs:
        k = max([i for i, c in enumerate(calls) if c["t"] <= s["t"]], default=0)
        dur = float(s.get("duration_ms", 0.0)) / 1000.0
        waits = k + 1 < len(calls) and calls[k + 1]["t"] >= s["t"] + dur
        if waits:
            waited_s[k] = max(waited_s[k], dur)
        cid = f"{wid}/{s.get('agent_id', f'sub{len(children)}')}"
        child = _convert_session(path, trace_id, cid, s["requests"], block, scale, max_tool_s,
                                 f"{where}.subagent[{s.get('agent_id')}]")
        child = child.model_copy(update={"meta": {**child.meta, "subagent_type": s.get("subagent_type"),
                                                  "duration_s": dur}})
        children.append(Child(after_turn=k, parent_waits=waits, workflow=child))

    turns: list[Turn] = []
    shrinks = 0
    for k, c in enumerate(calls):
        out = _scaled(int(_need(c, "out", path, f"{where}[{k}]")), scale, minimum=1)
        append = 0
        if k:
            target = _scaled(int(_need(c, "in", path, f"{where}[{k}]")), scale)
            append = target - (prompt + turns[-1].output_tokens)
            if append < 0:
                shrinks += 1
                append = 0
            prompt += turns[-1].output_tokens + append
        tool_s = 0.0
        if k + 1 < len(calls):
            gap = calls[k + 1]["t"] - c["t"] - float(c.get("api_time") or 0.0)
            tool_s = round(min(max(0.0, gap - waited_s[k]), max_tool_s), 3)
        turns.append(Turn(append_tokens=append, output_tokens=out, tool_s=tool_s))
    return Workflow(
        workflow_id=wid, prefix=prefix, prompt_tokens=task, turns=turns, children=children,
        source=f"weka:{path.name}",
        meta={"trace_in_last": int(calls[-1]["in"]), "context_shrinks": shrinks, "scale": scale},
    )


def convert_trace(path: str | Path, scale: float = 1.0, max_tool_s: float = DEFAULT_MAX_TOOL_S) -> Workflow:
    """One trace file as one root workflow (sub-agents as children)."""
    path = Path(path)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if not (math.isfinite(max_tool_s) and 0 <= max_tool_s <= MAX_TOOL_S):
        raise ValueError(f"max_tool_s must be in [0, {MAX_TOOL_S:g}], got {max_tool_s}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadError(path, None, None, f"invalid UTF-8 at byte {e.start}") from None
    data = load_json(text, path)
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise WorkloadError(path, None, "requests", "expected a JSON object with a 'requests' list")
    _check_requests(data["requests"], path, "requests")
    trace_id = str(data.get("id") or path.stem)
    block = int(_num(data, "block_size", path, "", default=TRACE_BLOCK_SIZE) or TRACE_BLOCK_SIZE)
    try:
        return _convert_session(path, trace_id, trace_id, data["requests"], block, scale, max_tool_s, "requests")
    except ValidationError as e:
        raise error_from_validation(path, None, e) from None


def trace_files(src: str | Path) -> list[Path]:
    """The trace files of a directory (``*.json`` except non-traces), or a single file."""
    src = Path(src)
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such trace file or directory")
    files = sorted(p for p in src.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.json trace files")
    return files


def convert_dir(src: str | Path, scale: float = 1.0, max_tool_s: float = DEFAULT_MAX_TOOL_S,
                limit: int | None = None) -> list[Workflow]:
    """Every trace in ``src`` (sorted by name) as root workflows."""
    files = trace_files(src)[:limit]
    return [convert_trace(f, scale=scale, max_tool_s=max_tool_s) for f in files]


def iter_gaps(src: str | Path, max_gap_s: float = DEFAULT_MAX_TOOL_S) -> Iterator[float]:
    """Gaps between consecutive calls of every session (sub-agents included), seconds, <= max_gap_s.

    Pairs where the earlier call lacks ``api_time`` are skipped (their gap includes LLM time).
    """
    def walk(reqs: list[dict[str, Any]]) -> Iterator[float]:
        calls = _calls(reqs)
        for a, b in itertools.pairwise(calls):
            if "api_time" in a:
                g = b["t"] - a["t"] - float(a["api_time"])
                if 0 < g <= max_gap_s:
                    yield g
        for r in reqs:
            if r.get("type") == "subagent" and r.get("requests"):
                yield from walk(r["requests"])

    for f in trace_files(src):
        yield from walk(json.loads(f.read_text(encoding="utf-8"))["requests"])
