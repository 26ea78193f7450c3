"""What the sidecar infers about sessions that never say when they end or who they are (issue 12).

* :class:`Continuity`: a generic session header (``X-Session-Id`` / ``x-session-affinity``, body
  ``session_id`` or ``prompt_cache_key`` alone) continues a workflow only when the call's prompt
  starts like the session's earlier calls (the same first two messages: system prompt and first
  user message, or ``instructions`` and the first input item). Router-stickiness keys shared by
  strangers (kv-cache-tester sets them) therefore never merge workflows: a prompt that does not
  extend the session's context is a new workflow (``<session>~N``), or, when it offers no tools
  while the session's agent calls did, a *side call* (OpenCode's title generation) that stays in
  the session but does not count as its context. Frontend-specific ids (Codex threads, OpenHands
  conversations, explicit ``X-MARS-Workflow``) are trusted as they are.
* :class:`ToolCallScan`: whether a response (JSON or SSE, fed chunk by chunk) contains a tool call.
  An agent's call that offered tools and got an answer without one is its final answer: the turn
  loop is over (the sidecar then ends the workflow softly).
* :class:`GapModel`: the idle timeout learned from observed return gaps (time from a call's end to
  the session's next call): a high percentile times a margin, within bounds.

Pure Python, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_mars.admission.identity import Identity

#: identity sources whose session id may be shared by strangers (checked by prefix)
GENERIC_SOURCES = frozenset({"opencode", "session_id", "prompt_cache_key"})
#: leading prompt items compared (system prompt + first user message)
PREFIX_ITEMS = 2


def offers_tools(body: Mapping[str, Any]) -> bool:
    """The call offers the model tools (an agent-loop call, not a side call)."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


def _item_key(item: Any) -> str:
    if isinstance(item, Mapping):
        item = {k: item.get(k) for k in ("role", "content", "type", "text") if k in item}
    try:
        data = json.dumps(item, sort_keys=True, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):  # (the sidecar bounds depth first; a second guard)
        data = f"<{type(item).__name__} {len(item) if isinstance(item, (list, dict)) else 0}>"
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def prompt_prefix(body: Mapping[str, Any]) -> tuple[str, ...]:
    """Hashes of the prompt's first ``PREFIX_ITEMS`` items (chat ``messages``; Responses
    ``instructions`` + ``input``; completions: the first 512 characters of ``prompt``)."""
    items: list[Any] = []
    if isinstance(body.get("messages"), list):
        items = body["messages"]
    else:
        if body.get("instructions"):
            items.append(body["instructions"])
        inp = body.get("input")
        if isinstance(inp, list):
            items += inp
        elif inp is not None:
            items.append(inp)
        if not items and body.get("prompt") is not None:
            p = body["prompt"]
            items = [p[:512] if isinstance(p, str) else p]
    return tuple(_item_key(x) for x in items[:PREFIX_ITEMS])


def _extends(prefix: tuple[str, ...], known: tuple[str, ...]) -> bool:
    n = min(len(prefix), len(known))
    return n > 0 and prefix[:n] == known[:n]


@dataclass
class _Variant:
    workflow: str
    prefix: tuple[str, ...]
    #: the prefix came from an agent call (one that offered tools)
    agent: bool


@dataclass
class _Session:
    variants: list[_Variant] = field(default_factory=list)
    splits: int = 0


@dataclass(frozen=True)
class Verdict:
    """What a call is to its session: ``first``, ``continue``, ``side_call`` or ``new_workflow``."""

    kind: str
    session: str
    workflow: str
    reason: str = ""

    def event(self) -> dict[str, Any] | None:
        if self.kind not in ("side_call", "new_workflow"):
            return None
        return {"kind": self.kind, "session": self.session, "workflow": self.workflow, "reason": self.reason}


class Continuity:
    """Prefix continuity of sessions named by generic ids (see the module docstring). Bounded LRU."""

    def __init__(self, capacity: int = 50_000, max_variants: int = 64) -> None:
        self.capacity = capacity
        self.max_variants = max_variants
        self._s: OrderedDict[str, _Session] = OrderedDict()

    def check(self, ident: Identity, body: Mapping[str, Any]) -> tuple[Identity, Verdict]:
        """``ident`` (renamed when the call starts a new workflow) and the verdict."""
        if ident.source not in GENERIC_SOURCES or not ident.is_root:
            return ident, Verdict("continue", ident.workflow, ident.workflow)
        key = ident.workflow
        prefix = prompt_prefix(body)
        agent = offers_tools(body)
        s = self._s.get(key)
        if s is None:
            s = self._s[key] = _Session([_Variant(key, prefix, agent)])
            if len(self._s) > self.capacity:
                self._s.popitem(last=False)
            return ident, Verdict("first", key, key)
        self._s.move_to_end(key)
        for v in s.variants:
            if _extends(prefix, v.prefix):
                if agent and not v.agent:
                    v.prefix, v.agent = prefix, True
                return self._as(ident, v.workflow), Verdict("continue", key, v.workflow)
        if not agent and any(v.agent for v in s.variants):
            v = next(v for v in s.variants if v.agent)
            return self._as(ident, v.workflow), Verdict(
                "side_call", key, v.workflow, "no tools offered and the prompt does not extend the session's "
                                              "agent context (e.g. title generation)")
        if agent:
            for v in s.variants:
                if not v.agent:  # the session's calls so far were side calls: this is its agent context
                    v.prefix, v.agent = prefix, True
                    return self._as(ident, v.workflow), Verdict("continue", key, v.workflow)
        s.splits += 1
        wf = f"{key}~{s.splits}"
        s.variants.append(_Variant(wf, prefix, agent))
        if len(s.variants) > self.max_variants:
            s.variants.pop(0)
        return self._as(ident, wf), Verdict(
            "new_workflow", key, wf, "the prompt does not extend the context of any workflow under this session id")

    @staticmethod
    def _as(ident: Identity, workflow: str) -> Identity:
        if workflow == ident.workflow:
            return ident
        return replace(ident, workflow=workflow, root=workflow)


#: a tool call in a chat answer (message or delta) or a Responses output item
_TOOL_CALL = re.compile(rb'"tool_calls"\s*:\s*\[\s*\{|"type"\s*:\s*"(?:function_call|custom_tool_call|'
                        rb'local_shell_call|mcp_call)"')
#: a call of the ``finish`` tool (OpenHands ends a conversation with it): a chat tool call's
#: function, or a Responses ``function_call`` item (its fields in either order; never the echoed
#: ``tools`` list, whose items are of type ``function``)
_FINISH_CALL = re.compile(rb'"function"\s*:\s*\{\s*"name"\s*:\s*"finish"|"type"\s*:\s*"function_call"[^{}]*?"name"'
                          rb'\s*:\s*"finish"|"name"\s*:\s*"finish"[^{}]*?"type"\s*:\s*"function_call"')
_CARRY = 160


class ToolCallScan:
    """Feed a response's chunks; ``saw_tool_call`` once any contained a tool call, ``finish_called``
    once one called the ``finish`` tool."""

    __slots__ = ("_tail", "finish_called", "saw_tool_call")

    def __init__(self) -> None:
        self.saw_tool_call = False
        self.finish_called = False
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if self.finish_called:
            return
        data = self._tail + chunk
        if not self.saw_tool_call and _TOOL_CALL.search(data):
            self.saw_tool_call = True
        if self.saw_tool_call and b'"finish"' in data and _FINISH_CALL.search(data):
            self.finish_called = True
        self._tail = data[-_CARRY:]


@dataclass
class GapModel:
    """Idle timeout from observed return gaps: ``percentile`` of the last ``window`` gaps times
    ``margin``, within [``min_s``, ``max_s``]; ``max_s`` until ``min_samples`` gaps were seen."""

    max_s: float = 600.0
    min_s: float = 10.0
    percentile: float = 95.0
    margin: float = 2.0
    min_samples: int = 8
    window: int = 512
    _gaps: deque = field(default_factory=deque, repr=False)
    _cached: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError(f"GapModel: need 0 < min_s <= max_s, got {self.min_s}, {self.max_s}")
        self._gaps = deque(maxlen=self.window)

    def observe(self, gap_s: float) -> None:
        if gap_s >= 0 and math.isfinite(gap_s):
            self._gaps.append(gap_s)
            self._cached = None

    @property
    def samples(self) -> int:
        return len(self._gaps)

    def timeout_s(self) -> float:
        if len(self._gaps) < self.min_samples:
            return self.max_s
        if self._cached is None:
            from vllm_mars.metrics.summary import percentile

            p = percentile(list(self._gaps), self.percentile) or 0.0
            self._cached = min(self.max_s, max(self.min_s, p * self.margin))
        return self._cached
