"""Workflow identity of one LLM call, read from ``SamplingParams.extra_args`` (OpenAI ``vllm_xargs``).

Keys (SPEC section 1): ``mars_workflow``, ``mars_root``, ``mars_parent``, ``mars_turn``,
``mars_last_step``, ``mars_tool``, ``mars_prefill_tokens``. A call without them is its own
one-call workflow (plain chat traffic mixes with agents), identified by its request id.
"""

from __future__ import annotations

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
    tool: str | None = None
    prefill_tokens: int | None = None
    #: False when the call carried no ``mars_workflow`` (a one-call workflow named by its request id).
    tagged: bool = True

    @property
    def is_child(self) -> bool:
        return self.parent is not None


def _as_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.strip().lower() in ("true", "1", "yes")
    raise ValueError(f"extra_args[{key!r}] must be a boolean, got {v!r}")


def _as_int(key: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"extra_args[{key!r}] must be an integer >= {minimum}, got {v!r}")
    try:
        iv = int(v)
    except ValueError:
        raise ValueError(f"extra_args[{key!r}] must be an integer >= {minimum}, got {v!r}") from None
    if iv != float(v) or iv < minimum:
        raise ValueError(f"extra_args[{key!r}] must be an integer >= {minimum}, got {v!r}")
    return iv


def _as_id(key: str, v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
        return str(v)
    raise ValueError(f"extra_args[{key!r}] must be a non-empty string, got {v!r}")


def workflow_from_extra_args(extra_args: Mapping[str, Any] | None, request_id: str) -> WorkflowInfo:
    """Parse the ``mars_*`` keys; other keys are ignored (they belong to other plugins).

    Raises ValueError naming the key and the expected type on a malformed value.
    """
    if not extra_args:
        return WorkflowInfo(workflow=request_id, root=request_id, last_step=True, tagged=False)
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
    prefill = (
        _as_int("mars_prefill_tokens", extra_args["mars_prefill_tokens"], 0)
        if extra_args.get("mars_prefill_tokens") is not None
        else None
    )
    return WorkflowInfo(workflow, root, parent, turn, last, tool, prefill, tagged)
