"""Converter for the agentic-coding session traces of the public ``callanjfox/kv-cache-tester`` repository (its ``traces/``; a sample ships in ``benchmark/workloads/weka_sample/``).

One trace file (one coding-agent session) becomes one root workflow:

* each non-``subagent`` request is a turn, in time order; ``out`` -> ``output_tokens``;
* the first request's ``hash_ids`` (one per 64-token block) become keyed prefix segments, cut
  where the first requests of the trace's sessions (root and sub-agents) stop sharing blocks: a
  segment ``"<trace id>:<hash id of its first block>"`` covers a run of blocks, so blocks the trace
  shares as a common prefix (e.g. the system prompt of every ``Explore`` sub-agent) get identical
  token ids and share vLLM's prefix cache, and a 2M-block prefix is one segment, not 2M; the
  tokens past the last full block are task tokens;
* turn k's ``append_tokens`` makes turn k's prompt as long as the trace's ``in`` (scaled):
  ``round(in_k / scale) - (prompt_{k-1} + output_{k-1})``;
* where the recorded context shrank (``in_k < in_{k-1} + out_{k-1}``: thinking blocks dropped, a
  compaction), turn k compacts (schema v2): it keeps the blocks its ``hash_ids`` share with the
  previous request's (what the prefix cache still holds) and the rest of ``in_k`` is new summary
  tokens, so every replayed prompt is as long as the trace's (counted in ``meta.compactions``);
* with ``max_context``, a call that would not fit (prompt + output) compacts as an agent does at
  its model's limit: it keeps the system prompt and tool definitions (the trace's
  ``system_tokens + tool_tokens``, whole blocks, at most the first prompt's prefix), adds
  ``summary_tokens`` of summary, then its own new input (cut to what fits when one input alone is
  larger than the window, as frontends truncate a huge tool output: ``meta.truncated_inputs``);
  later turns follow the trace's growth from there (counted in ``meta.forced_compactions``);
* tool time after turn k = ``t[k+1] - t[k] - api_time[k]`` (tool plus client time, as the trace
  README defines the gap), clipped to ``max_tool_s`` (longer gaps are a user away, not a tool);
  a request without ``api_time`` counts it as 0;
* a ``subagent`` entry becomes a child workflow ``"<trace id>/<agent_id>"`` (a repeated agent id
  gets ``#2``, ``#3``, ...: ids stay unique; ``meta.agent_id`` keeps the recorded one) started after the last
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
    Compact,
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
            aid = r.get("agent_id")
            if aid is not None and not isinstance(aid, (str, int)) or isinstance(aid, bool):
                raise WorkloadError(path, None, f"{at}.agent_id", f"must be a string, got {type(aid).__name__}")
            if r.get("requests"):
                _check_requests(r["requests"], path, f"{at}.requests", depth + 1)
            continue
        for key in ("in", "out"):
            _num(r, key, path, at)
        _num(r, "api_time", path, at, default=0.0)
        hashes = r.get("hash_ids", [])
        if (not isinstance(hashes, list) or len(hashes) > MAX_TOKENS
                or not all(type(h) is int or type(h) is str for h in hashes)):
            raise WorkloadError(path, None, f"{at}.hash_ids", "must be a list of block ids (integers or strings)")


def _lcp(a: list, b: list) -> int:
    """Length of the common prefix of two lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _first_hashes(requests: list[dict[str, Any]], out: list[list]) -> list[list]:
    """The first call's ``hash_ids`` of this session and of every sub-agent in it."""
    calls = _calls(requests)
    if calls:
        out.append(calls[0].get("hash_ids") or [])
    for r in requests:
        if r.get("type") == "subagent" and r.get("requests"):
            _first_hashes(r["requests"], out)
    return out


class _Session:
    """What every session of one trace file shares: the cut points of the first prompts' blocks,
    the workflow ids used so far and the conversion parameters."""

    def __init__(self, path: Path, trace_id: str, requests: list[dict[str, Any]], block: int, scale: float,
                 max_tool_s: float, max_context: int | None, summary_tokens: int, keep_tokens: int):
        self.path, self.trace_id, self.block, self.scale = path, trace_id, block, scale
        self.max_tool_s, self.max_context, self.summary_tokens = max_tool_s, max_context, summary_tokens
        self.bt = max(1, round(block / scale))
        self.keep_tokens = keep_tokens
        self.firsts = [h for h in _first_hashes(requests, []) if h]
        self.ids: set[str] = set()

    def prefix(self, hashes: list) -> list[Segment]:
        """Keyed segments for a first prompt's blocks, cut where another session's first prompt
        stops sharing them (their common prefix is all vLLM's prefix cache can reuse)."""
        cuts = {0, len(hashes)}
        for other in self.firsts:
            if other is not hashes:
                n = _lcp(hashes, other)
                if 0 < n < len(hashes):
                    cuts.add(n)
        bounds = sorted(cuts)
        return [Segment(key=f"{self.trace_id}:{hashes[a]}", tokens=self.bt * (b - a))
                for a, b in itertools.pairwise(bounds)]

    def unique_id(self, wid: str) -> str:
        out, n = wid, 1
        while out in self.ids:
            n += 1
            out = f"{wid}#{n}"
        self.ids.add(out)
        return out


def _convert_session(ses: _Session, wid: str, requests: list[dict[str, Any]], where: str) -> Workflow:
    path, scale = ses.path, ses.scale
    wid = ses.unique_id(wid)
    calls = _calls(requests)
    if not calls:
        raise WorkloadError(path, None, where, "a session without any non-subagent request")
    bt, block = ses.bt, ses.block
    first = calls[0]
    hashes = _need(first, "hash_ids", path, f"{where}[0]")
    first_in = int(_need(first, "in", path, f"{where}[0]"))
    task = _scaled(max(0, first_in - block * len(hashes)), scale)
    truncated = 0
    first_out = _scaled(int(_need(first, "out", path, f"{where}[0]")), scale, minimum=1)
    if ses.max_context is not None and bt * len(hashes) + task + first_out > ses.max_context:
        # a first prompt larger than the window: its tail is cut, as a frontend cuts a huge input
        room = ses.max_context - first_out
        if room < 1:
            raise WorkloadError(path, None, f"{where}[0].out",
                                f"{first_out} output tokens leave no room under max_context={ses.max_context}")
        hashes = hashes[: min(len(hashes), room // bt)]
        task = min(task, room - bt * len(hashes))
        truncated = 1
    prefix = ses.prefix(hashes)
    if not prefix and task == 0:
        task = 1
    prompt = bt * len(hashes) + task
    # the system prompt and tools a forced compaction keeps: whole blocks, within the first prefix
    sys_keep = min(bt * len(hashes), bt * (ses.keep_tokens // block))

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
        aid = s.get("agent_id", f"sub{len(children)}")
        child = _convert_session(ses, f"{wid}/{aid}", s["requests"], f"{where}.subagent[{aid}]")
        child = child.model_copy(update={"meta": {**child.meta, "agent_id": aid,
                                                  "subagent_type": s.get("subagent_type"), "duration_s": dur}})
        children.append(Child(after_turn=k, parent_waits=waits, workflow=child))

    turns: list[Turn] = []
    natural = forced = 0
    offset = 0          # scaled trace context the replay no longer carries (after forced compactions)
    kept_forced = None  # what the last forced compaction kept (a later natural one keeps no more)
    for k, c in enumerate(calls):
        at = f"{where}[{k}]"
        out = _scaled(int(_need(c, "out", path, at)), scale, minimum=1)
        append, compact = 0, None
        before = 0
        if k:
            p = calls[k - 1]
            before = prompt + turns[-1].output_tokens
            target = _scaled(int(_need(c, "in", path, at)), scale)
            if c["in"] < p["in"] + p["out"]:  # the recorded context shrank: a compaction
                keep = bt * _lcp(p.get("hash_ids") or [], c.get("hash_ids") or [])
                if kept_forced is not None:
                    keep = min(keep, kept_forced)
                keep = min(keep, before, target)
                compact = Compact(keep_tokens=keep, summary_tokens=target - keep)
                natural += 1
                offset, kept_forced = 0, None
                prompt = target
            else:
                append = max(0, target - offset - before)
                prompt = before + append
        if ses.max_context is not None and prompt + out > ses.max_context:
            keep = min(sys_keep, before)
            new = append if compact is None else 0
            room = ses.max_context - keep - ses.summary_tokens - out
            if room < 0:
                raise WorkloadError(path, None, f"{at}.out",
                                    f"does not fit max_context={ses.max_context} even compacted: kept "
                                    f"{keep} + summary {ses.summary_tokens} + output {out}")
            if new > room:  # one tool output larger than the window: truncated, as frontends do
                new, truncated = room, truncated + 1
            squeezed = keep + ses.summary_tokens + new
            offset += prompt - squeezed
            prompt, append, kept_forced = squeezed, new, keep
            compact = Compact(keep_tokens=keep, summary_tokens=ses.summary_tokens)
            forced += 1
        tool_s = 0.0
        if k + 1 < len(calls):
            gap = calls[k + 1]["t"] - c["t"] - float(c.get("api_time") or 0.0)
            tool_s = round(min(max(0.0, gap - waited_s[k]), ses.max_tool_s), 3)
        turns.append(Turn(append_tokens=append, output_tokens=out, tool_s=tool_s, compact=compact))
    return Workflow(
        workflow_id=wid, prefix=prefix, prompt_tokens=task, turns=turns, children=children,
        source=f"weka:{path.name}",
        meta={"trace_in_last": int(calls[-1]["in"]), "compactions": natural, "forced_compactions": forced,
              "truncated_inputs": truncated, "scale": scale},
    )


def convert_trace(path: str | Path, scale: float = 1.0, max_tool_s: float = DEFAULT_MAX_TOOL_S,
                  max_context: int | None = None, summary_tokens: int | None = None) -> Workflow:
    """One trace file as one root workflow (sub-agents as children). With ``max_context`` (tokens,
    after scaling), a call that would pass it compacts first, keeping the trace's system prompt and
    tools plus ``summary_tokens`` (default ``max_context // 10``)."""
    path = Path(path)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if not (math.isfinite(max_tool_s) and 0 <= max_tool_s <= MAX_TOOL_S):
        raise ValueError(f"max_tool_s must be in [0, {MAX_TOOL_S:g}], got {max_tool_s}")
    if max_context is not None and not 2 <= max_context <= MAX_TOKENS:
        raise ValueError(f"max_context must be in [2, {MAX_TOKENS}], got {max_context}")
    if summary_tokens is None:
        summary_tokens = 0 if max_context is None else max_context // 10
    if not 0 <= summary_tokens <= (max_context or MAX_TOKENS):
        raise ValueError(f"summary_tokens must be in [0, max_context], got {summary_tokens}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadError(path, None, None, f"invalid UTF-8 at byte {e.start}") from None
    data = load_json(text, path)
    del text
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise WorkloadError(path, None, "requests", "expected a JSON object with a 'requests' list")
    _check_requests(data["requests"], path, "requests")
    trace_id = str(data.get("id") or path.stem)
    block = int(_num(data, "block_size", path, "", default=TRACE_BLOCK_SIZE) or TRACE_BLOCK_SIZE)
    keep = int(_num(data, "system_tokens", path, "", default=0.0) + _num(data, "tool_tokens", path, "", default=0.0))
    ses = _Session(path, trace_id, data["requests"], block, scale, max_tool_s, max_context, summary_tokens, keep)
    try:
        return _convert_session(ses, trace_id, data["requests"], "requests")
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


def iter_convert_dir(src: str | Path, scale: float = 1.0, max_tool_s: float = DEFAULT_MAX_TOOL_S,
                     limit: int | None = None, max_context: int | None = None,
                     summary_tokens: int | None = None) -> Iterator[Workflow]:
    """Every trace in ``src`` (sorted by name) as root workflows, one at a time (a writer streams
    them: memory is one trace's, not the directory's). Root ids must differ across files."""
    seen: dict[str, Path] = {}
    for f in trace_files(src)[:limit]:
        wf = convert_trace(f, scale=scale, max_tool_s=max_tool_s, max_context=max_context,
                           summary_tokens=summary_tokens)
        if wf.workflow_id in seen:
            raise WorkloadError(f, None, "id", f"trace id {wf.workflow_id!r} is also the id of {seen[wf.workflow_id]}")
        seen[wf.workflow_id] = f
        yield wf


def convert_dir(src: str | Path, scale: float = 1.0, max_tool_s: float = DEFAULT_MAX_TOOL_S,
                limit: int | None = None, max_context: int | None = None,
                summary_tokens: int | None = None) -> list[Workflow]:
    """Every trace in ``src`` (sorted by name) as root workflows."""
    return list(iter_convert_dir(src, scale, max_tool_s, limit, max_context, summary_tokens))


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
