"""Workflow identity of one LLM call, read from ``SamplingParams.extra_args`` (OpenAI ``vllm_xargs``).

Keys (SPEC section 1): ``mars_workflow``, ``mars_root``, ``mars_parent``, ``mars_turn``,
``mars_last_step``, ``mars_tool``, ``mars_next_tool``, ``mars_prefill_tokens``. A call without them
is its own one-call workflow (plain chat traffic mixes with agents), identified by its request id.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

WORKFLOW_KEYS = (
    "mars_workflow",
    "mars_root",
    "mars_parent",
    "mars_turn",
    "mars_last_step",
    "mars_tool",
    "mars_next_tool",
    "mars_prefill_tokens",
)


@dataclass(frozen=True, slots=True)
class WorkflowInfo:
    """Who a call belongs to. ``workflow`` is never empty; ``root`` defaults to ``workflow``."""

    workflow: str
    root: str
    parent: str | None = None
    turn: int = 0
    last_step: bool = False
    #: The tool that ran before this call (``mars_tool``: the one its previous turn called).
    tool: str | None = None
    prefill_tokens: int | None = None
    #: The tool this call's output will call (``mars_next_tool``), when the client knows it.
    next_tool: str | None = None
    #: False when the call carried no ``mars_workflow`` (a one-call workflow named by its request id).
    tagged: bool = True

    @property
    def is_child(self) -> bool:
        return self.parent is not None


#: Largest integer tag accepted (``mars_turn``, ``mars_prefill_tokens``): exact as a float, so
#: policies may do float arithmetic on it without OverflowError.
MAX_TAG_INT = 2**53
#: Longest id a tag may carry (``mars_workflow``, ``mars_root``, ``mars_parent``, ``mars_tool``,
#: ``mars_next_tool``):
#: policies keep per-workflow and per-tool state keyed by them, so their size is bounded.
MAX_ID_CHARS = 1024
#: Longest id kept verbatim in logs and events (:func:`short_id`).
LOG_ID_CHARS = 200


def short_id(v: Any, limit: int = LOG_ID_CHARS) -> Any:
    """``v`` for a log line: strings longer than ``limit`` are cut and marked with their length."""
    if isinstance(v, str) and len(v) > limit:
        return f"{v[:limit]}...({len(v)} chars)"
    return v


def _show(v: Any) -> str:
    """A bounded repr of a client value for an error message (never raises)."""
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 - int-to-str digit limits and the like
        r = f"<{type(v).__name__}>"
    return r if len(r) <= 80 else f"{r[:77]}..."


def _as_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.strip().lower() in ("true", "1", "yes")
    raise ValueError(f"extra_args[{key!r}] must be a boolean, got {_show(v)}")


def _as_int(key: str, v: Any, minimum: int) -> int:
    bad = ValueError(f"extra_args[{key!r}] must be an integer in [{minimum}, 2**53], got {_show(v)}")
    if isinstance(v, bool):
        raise bad
    if isinstance(v, str):
        s = v.strip()
        if not s or len(s) > 20:
            raise bad
        try:
            v = int(s) if s.lstrip("+-").isdigit() else float(s)
        except ValueError:
            raise bad from None
    if isinstance(v, float):
        # inf, -inf, nan and fractions are not integers (int(inf) raises OverflowError).
        if not (math.isfinite(v) and abs(v) <= MAX_TAG_INT and v.is_integer()):
            raise bad
        v = int(v)
    if not isinstance(v, int) or not minimum <= v <= MAX_TAG_INT:
        raise bad
    return v


def _as_id(key: str, v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, str) and 0 < len(v) <= MAX_ID_CHARS:
        return v
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_TAG_INT:
        return str(v)
    raise ValueError(f"extra_args[{key!r}] must be a non-empty string of at most {MAX_ID_CHARS} characters, "
                     f"got {_show(v)}")


def workflow_from_extra_args(extra_args: Mapping[str, Any] | None, request_id: str) -> WorkflowInfo:
    """Parse the ``mars_*`` keys; other keys are ignored (they belong to other plugins).

    Raises ValueError naming the key and the expected type on a malformed value, and nothing
    else whatever the values are (every JSON value kind, any size): callers serve such a call as
    an untagged one.
    """
    if not extra_args:
        return WorkflowInfo(workflow=request_id, root=request_id, last_step=True, tagged=False)
    if not isinstance(extra_args, Mapping):
        raise ValueError(f"extra_args must be a JSON object, got {type(extra_args).__name__}")  # noqa: TRY004
    workflow = _as_id("mars_workflow", extra_args.get("mars_workflow"))
    tagged = workflow is not None
    if workflow is None:
        workflow = request_id
    root = _as_id("mars_root", extra_args.get("mars_root")) or workflow
    parent = _as_id("mars_parent", extra_args.get("mars_parent"))
    turn = _as_int("mars_turn", extra_args["mars_turn"], 0) if "mars_turn" in extra_args else 0
    if "mars_last_step" in extra_args:
        last = _as_bool("mars_last_step", extra_args["mars_last_step"])
    else:
        last = not tagged
    tool = _as_id("mars_tool", extra_args.get("mars_tool"))
    next_tool = _as_id("mars_next_tool", extra_args.get("mars_next_tool"))
    prefill = (
        _as_int("mars_prefill_tokens", extra_args["mars_prefill_tokens"], 0)
        if extra_args.get("mars_prefill_tokens") is not None
        else None
    )
    return WorkflowInfo(workflow, root, parent, turn, last, tool, prefill, next_tool, tagged)


#: characters an id keeps as they are when encoded (RFC 3986 unreserved: safe in a header value,
#: a URL path segment and a file name)
_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_SAFE_RUN = re.compile(r"[A-Za-z0-9._~-]+")
#: longest directory name :func:`safe_dirname` returns (file systems allow 255 bytes)
DIRNAME_CHARS = 120


def safe_id(v: str) -> str:
    """``v`` in a form that is safe as an HTTP header value, a URL path segment and a directory
    name, and unique per id: RFC 3986 unreserved characters stay as they are, every other
    character is percent-encoded from its UTF-8 bytes (``%`` itself too), and the ids ``.`` and
    ``..`` become ``%2E`` and ``%2E%2E``. The mapping is one to one
    (``urllib.parse.unquote(safe_id(v)) == v``), so an id that is not safe as is gets encoded,
    never collapsed onto another; it is the URL-path form of the id (the finish route takes it)."""
    if _SAFE_RUN.fullmatch(v):
        return v if v not in (".", "..") else "%2E" * len(v)
    out = []
    for c in v:
        if c in _SAFE_CHARS:
            out.append(c)
        else:
            out.extend(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
    return "".join(out) or "%"  # (the empty id, which no path accepts, still gets a name)


def safe_dirname(v: str, limit: int = DIRNAME_CHARS) -> str:
    """:func:`safe_id` bounded to ``limit`` characters for a directory name: a longer encoding
    keeps its first characters and ends with ``%h`` and a hash of the whole id (``%h`` is never
    part of an encoding, so a bounded name cannot equal another id's name)."""
    s = safe_id(v)
    if len(s) <= limit:
        return s
    digest = hashlib.blake2b(v.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return s[: limit - 34] + "%h" + digest
