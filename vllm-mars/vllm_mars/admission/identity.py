"""One workflow identity from what agent frontends already send (SPEC section 1).

Sources, in precedence order for the session id (the first that is present wins):

===================  ==========================================  =====================================
source               this session                                parent / root
===================  ==========================================  =====================================
``mars``             header ``X-MARS-Workflow``                  ``X-MARS-Parent``, ``X-MARS-Root``
                     (alias ``x-mars-workflow-id``)
``vllm_xargs``       body ``vllm_xargs.mars_workflow``           ``mars_parent``, ``mars_root``
``opencode``         header ``X-Session-Id``                     ``x-parent-session-id``
                     (or ``x-session-affinity``)
``codex``            header ``session_id`` / ``session-id`` /    ``x-codex-parent-thread-id``; body
                     ``thread-id``                               ``prompt_cache_key`` = root thread
``openhands``        header ``x-litellm-session-id``             body ``prompt_cache_key`` = root
                                                                 conversation (children keep it)
``session_id``       body ``session_id`` (vLLM-native)           -
``prompt_cache_key`` body ``prompt_cache_key`` alone             -
``anonymous``        none: a one-call workflow with a fresh id   -
===================  ==========================================  =====================================

The root is ``X-MARS-Root`` / ``mars_root`` when given, else a ``prompt_cache_key`` that differs
from the session id (OpenHands and Codex children keep their root's key), else the root of the
parent as remembered by :class:`SessionTable` (nested sub-agents), else the parent, else the
session itself. Turn, last-step, tool and prefill estimate come from ``X-MARS-Turn`` /
``X-MARS-Last-Step`` headers or the ``vllm_xargs`` ``mars_*`` keys. Pure Python.
"""

from __future__ import annotations

import itertools
import json
import math
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from vllm_mars.workflow import _as_bool, _as_id, _as_int


@dataclass(frozen=True)
class Identity:
    """Who one HTTP call belongs to, normalised."""

    workflow: str
    root: str
    parent: str | None
    #: which frontend convention produced ``workflow`` (see the module table)
    source: str
    turn: int | None = None
    last_step: bool | None = None
    tool: str | None = None
    prefill_tokens: int | None = None

    @property
    def is_root(self) -> bool:
        return self.workflow == self.root

    @property
    def anonymous(self) -> bool:
        return self.source == "anonymous"


#: one-call workflow ids: a random per-process prefix and a counter (cheaper than a uuid per call)
_ANON_PREFIX = uuid.uuid4().hex[:12]
_anon_counter = itertools.count()


def _h(headers: Mapping[str, str], *names: str) -> str | None:
    """First non-empty header among ``names`` (``headers`` must have lower-case keys)."""
    for n in names:
        v = headers.get(n)
        if v is not None and v.strip():
            return v.strip()
    return None


def _body_id(body: Mapping[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v).strip():
        return str(v).strip()
    raise ValueError(f"body field {key!r} must be a non-empty string, got {v!r}")


def identify(headers: Mapping[str, str], body: Mapping[str, Any]) -> Identity:
    """Normalise a call's identity. ``headers`` keys must be lower-case (ASGI gives them so).

    Raises ValueError naming the field on a malformed value (the sidecar answers 400).
    """
    xargs = body.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, Mapping):
        raise ValueError(f"body field 'vllm_xargs' must be a JSON object, got {type(xargs).__name__}")  # noqa: TRY004 (a 400)
    pck = _body_id(body, "prompt_cache_key")

    workflow = parent = root = None
    source = "anonymous"
    if (w := _h(headers, "x-mars-workflow", "x-mars-workflow-id")) is not None:
        workflow, source = w, "mars"
        parent = _h(headers, "x-mars-parent")
        root = _h(headers, "x-mars-root")
    elif (w := _as_id("mars_workflow", xargs.get("mars_workflow"))) is not None:
        workflow, source = w, "vllm_xargs"
        parent = _as_id("mars_parent", xargs.get("mars_parent"))
        root = _as_id("mars_root", xargs.get("mars_root"))
    elif (w := _h(headers, "x-session-id", "x-session-affinity")) is not None:
        workflow, source = w, "opencode"
        parent = _h(headers, "x-parent-session-id")
    elif (w := _h(headers, "session_id", "session-id", "thread-id")) is not None:
        workflow, source = w, "codex"
        parent = _h(headers, "x-codex-parent-thread-id")
        if pck is not None and pck != workflow:
            root = pck
    elif (w := _h(headers, "x-litellm-session-id")) is not None:
        workflow, source = w, "openhands"
        if pck is not None and pck != workflow:
            root = parent = pck
    elif (w := _body_id(body, "session_id")) is not None:
        workflow, source = w, "session_id"
    elif pck is not None:
        workflow, source = pck, "prompt_cache_key"

    if source in ("mars", "vllm_xargs") and parent is None and root is None:
        # an explicit id may still ride with a frontend's parent link
        parent = _h(headers, "x-parent-session-id", "x-codex-parent-thread-id")

    turn = last = tool = prefill = None
    if (v := _h(headers, "x-mars-turn")) is not None:
        turn = _as_int("X-MARS-Turn", v, 0)
    elif "mars_turn" in xargs:
        turn = _as_int("mars_turn", xargs["mars_turn"], 0)
    if (v := _h(headers, "x-mars-last-step")) is not None:
        last = _as_bool("X-MARS-Last-Step", v)
    elif "mars_last_step" in xargs:
        last = _as_bool("mars_last_step", xargs["mars_last_step"])
    tool = _h(headers, "x-mars-tool") or _as_id("mars_tool", xargs.get("mars_tool"))
    if xargs.get("mars_prefill_tokens") is not None:
        prefill = _as_int("mars_prefill_tokens", xargs["mars_prefill_tokens"], 0)

    if workflow is None:
        workflow = f"anon-{_ANON_PREFIX}-{next(_anon_counter)}"
        last = True  # a plain call is its own one-call workflow
    if root is None:
        root = parent or workflow
    return Identity(workflow, root, parent, source, turn, last, tool, prefill)


class SessionTable:
    """Remembers session -> root so that a grandchild that names only its parent lands in the
    right root (bounded LRU; an evicted session falls back to "its parent is the root")."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"SessionTable capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._root: OrderedDict[str, str] = OrderedDict()
        self._members: dict[str, set[str]] = {}  # root -> its sessions (for forget_root)

    def resolve(self, ident: Identity) -> Identity:
        root = ident.root
        if ident.parent is not None and root == ident.parent:
            root = self._root.get(ident.parent, ident.parent)
        if root != ident.root:
            ident = replace(ident, root=root)
        wf = ident.workflow
        old = self._root.get(wf)
        if old is not None and old != ident.root:
            self._drop_member(old, wf)
        self._root[wf] = ident.root
        self._root.move_to_end(wf)
        self._members.setdefault(ident.root, set()).add(wf)
        if len(self._root) > self.capacity:
            s, r = self._root.popitem(last=False)
            self._drop_member(r, s)
        return ident

    def _drop_member(self, root: str, session: str) -> None:
        m = self._members.get(root)
        if m is not None:
            m.discard(session)
            if not m:
                del self._members[root]

    def forget_root(self, root: str) -> set[str]:
        """Drop a root's sessions; returns them."""
        members = self._members.pop(root, set())
        for s in members:
            self._root.pop(s, None)
        return members

    def __len__(self) -> int:
        return len(self._root)


_TEXT_KEYS = ("content", "text", "input", "arguments", "output", "tool_calls", "function")


def _text_len(x: Any) -> int:
    """Characters of prompt text in ``x`` (strings under the text-bearing keys of messages and
    items, through lists). Iterative: any nesting depth costs no stack."""
    n = 0
    stack = [x]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v[k] for k in _TEXT_KEYS if k in v)
    return n


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """A tokenizer-free prompt estimate: characters / 4 over messages, prompt, input, tools; a
    token-id prompt (``[ids]`` or ``[[ids], ...]``) counts its ids exactly."""
    n = 0
    for key in ("messages", "prompt", "input", "instructions"):
        if key in body:
            n += _text_len(body[key])
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        for p in prompt if prompt and isinstance(prompt[0], list) else [prompt]:
            if isinstance(p, list):
                n += 4 * sum(1 for t in p if isinstance(t, int) and not isinstance(t, bool))
    if "tools" in body:
        try:
            n += len(json.dumps(body["tools"]))
        except (TypeError, ValueError):
            pass
    return math.ceil(n / 4)


def apply_to_body(body: dict[str, Any], ident: Identity, turn: int) -> dict[str, Any]:
    """Write the normalised ids into ``body["vllm_xargs"]`` (other keys there are kept)."""
    xargs = dict(body.get("vllm_xargs") or {})
    xargs["mars_workflow"] = ident.workflow
    xargs["mars_root"] = ident.root
    if ident.parent is not None:
        xargs["mars_parent"] = ident.parent
    else:
        xargs.pop("mars_parent", None)
    xargs["mars_turn"] = ident.turn if ident.turn is not None else turn
    if ident.last_step is not None:
        xargs["mars_last_step"] = ident.last_step
    if ident.tool is not None:
        xargs["mars_tool"] = ident.tool
    if ident.prefill_tokens is not None:
        xargs["mars_prefill_tokens"] = ident.prefill_tokens
    body["vllm_xargs"] = xargs
    return body
