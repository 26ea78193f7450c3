"""Workload schema v2 (reads v1): one agent workflow per JSONL line, validated with pydantic.

A line looks like::

    {"schema": "mars_workload_v1", "workflow_id": "ilr1-0007", "arrival_s": 12.5,
     "prefix": [{"key": "sys-coder", "tokens": 2048}], "prompt_tokens": 1500,
     "turns": [{"output_tokens": 180, "tool": "bash", "tool_s": 4.2},
               {"append_tokens": 900, "output_tokens": 120}],
     "children": [{"after_turn": 0, "workflow": {"workflow_id": "ilr1-0007.a", ...}}]}

The first call's prompt is the ``prefix`` segments followed by ``prompt_tokens`` task tokens.
A segment with a ``key`` gets the same token ids in every workflow that names the key (a shared
system prompt, or a trace's hash block), so vLLM's prefix cache sees real sharing; task tokens and
appended tool output are unique to their workflow. Turn k's prompt is turn k-1's prompt + turn
k-1's output + turn k's ``append_tokens`` (the tool output). Children are nested workflows
(sub-agents) that start after a parent turn; the parent's next turn waits for them when
``parent_waits`` (a sub-agent called as a tool), else runs concurrently.

Schema v2 adds context compaction: a turn with ``"compact": {"keep_tokens": K, "summary_tokens": S}``
restarts its prompt as the first K tokens of the previous context (turn k-1's prompt + output; what
the prefix cache can still hit, e.g. the system prompt) + S new summary tokens + its
``append_tokens``. A v1 line is read as before; a v1 line that uses ``compact`` is an error, and
:func:`dump_line` writes v1 for a workflow that uses no v2 field (old readers keep working).

Errors from :func:`load_workload` name the file, the line and the field
(``w.jsonl:3: turns[2].output_tokens: Input should be greater than or equal to 1``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from vllm_mars.workflow import MAX_ID_CHARS

#: Values of the versioned ``schema`` field of every top-level line: v2 adds ``turns[k].compact``.
SCHEMA_V1 = "mars_workload_v1"
SCHEMA_V2 = "mars_workload_v2"
#: The workload schemas this reader accepts, oldest first.
WORKLOAD_SCHEMAS = (SCHEMA_V1, SCHEMA_V2)
#: The preview's live-agent task format (read by :mod:`vllm_mars.workload.mas_task`).
MAS_TASK_V1 = "mas_task_v1"
#: Sanity bounds, checked before anything is materialised: a token count above MAX_TOKENS, a tool
#: time above MAX_TOOL_S (one day), an arrival beyond MAX_ARRIVAL_S or children nested deeper than
#: MAX_DEPTH is a typo or an attack, not a workload.
MAX_TOKENS = 1 << 24
MAX_TOOL_S = 86_400.0
MAX_ARRIVAL_S = 1e7
MAX_DEPTH = 32
#: Longest workflow id: the engine's tag limit (``vllm_mars.workflow.MAX_ID_CHARS``) less room for
#: the ``~k`` suffix a replay adds to repeats, so every call of a valid workload is tagged.
MAX_WORKFLOW_ID_CHARS = MAX_ID_CHARS - 24


class WorkloadError(ValueError):
    """A workload file is malformed; the message names file, line and field."""

    def __init__(self, path: str | Path, line: int | None, field: str | None, msg: str):
        self.path, self.line, self.field, self.msg = str(path), line, field, msg
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {field}: {msg}" if field else f"{where}: {msg}")


def _field_error(field: str, msg: str) -> PydanticCustomError:
    """A validator error that keeps the offending field's path (joined onto the model's loc)."""
    return PydanticCustomError("workload_field", msg, {"field": field})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Segment(_Strict):
    """A run of prompt tokens. Same ``key`` (and token count) -> same token ids everywhere."""

    tokens: int = Field(ge=1, le=MAX_TOKENS, description="number of tokens in the segment")
    key: str | None = Field(default=None, min_length=1,
                            description="sharing key; None makes the segment unique to its workflow")


class Compact(_Strict):
    """Context compaction before a turn (schema v2): the prompt restarts with a shorter summary."""

    keep_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS,
                             description="leading tokens of the previous context kept (the prefix cache "
                                         "can hit them); at most turn k-1's prompt + output")
    summary_tokens: int = Field(ge=0, le=MAX_TOKENS,
                                description="new summary tokens after the kept ones (unique: a cache miss)")


class Turn(_Strict):
    """One LLM call of a workflow and the tool that runs after it."""

    compact: Compact | None = Field(default=None,
                                    description="schema v2: restart the prompt (keep + summary) before "
                                                "this call's append")
    append_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS,
                               description="tool-output tokens appended before this call (0 on turn 0)")
    output_tokens: int = Field(ge=1, le=MAX_TOKENS,
                               description="tokens this call generates (ignore_eos, max_tokens)")
    tool_s: float = Field(default=0.0, ge=0.0, le=MAX_TOOL_S, allow_inf_nan=False,
                          description="simulated tool time after this call, s")
    tool: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS,
                             description="name of the tool called after this call")
    tool_cmd: str | None = Field(default=None, description="shell command for real tool execution")


class CallLengths:
    """The prompt and context lengths of a workflow's calls, for the schema's :class:`Workflow` and
    the driver's token-id plan alike: call 0's prompt is :meth:`first_prompt_tokens`; call k's is
    call k-1's prompt + output + append, or after a compaction the kept head + summary + append
    (each turn's tokens from :meth:`turn_tokens`; every call emits its full output)."""

    def first_prompt_tokens(self) -> int:
        raise NotImplementedError

    def turn_tokens(self) -> Iterator[tuple[int, int, int | None, int]]:
        """(output, append, kept head or None without a compaction, summary) tokens per turn."""
        raise NotImplementedError

    def prompt_lengths(self) -> list[int]:
        """Prompt length of every call."""
        n, out, prev_output = self.first_prompt_tokens(), [], 0
        for k, (output, append, keep, summary) in enumerate(self.turn_tokens()):
            if k:
                n = (keep + summary if keep is not None else n + prev_output) + append
            out.append(n)
            prev_output = output
        return out

    def final_prompt_tokens(self) -> int:
        """Prompt length of the last call."""
        return self.prompt_lengths()[-1]

    def peak_context_tokens(self) -> int:
        """The most context any call needs (its prompt + its output): what must fit max_model_len."""
        return max(p + t[0] for p, t in zip(self.prompt_lengths(), self.turn_tokens(), strict=True))


class Workflow(CallLengths, _Strict):
    """A workflow (root session or child sub-agent)."""

    workflow_id: str = Field(min_length=1, max_length=MAX_WORKFLOW_ID_CHARS)
    arrival_s: float | None = Field(default=None, ge=0.0, le=MAX_ARRIVAL_S, allow_inf_nan=False,
                                    description="offset from the run start; None lets the driver decide")
    prefix: list[Segment] = Field(default_factory=list, description="shared prompt segments, in order")
    prompt_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS, description="task-specific tokens after the prefix")
    turns: list[Turn] = Field(min_length=1)
    children: list[Child] = Field(default_factory=list)
    source: str | None = Field(default=None, description="where the workflow came from (preset, trace)")
    meta: dict[str, Any] = Field(default_factory=dict, description="free-form provenance")

    @model_validator(mode="after")
    def _check(self) -> Workflow:
        if self.prompt_tokens + sum(s.tokens for s in self.prefix) < 1:
            raise _field_error("prompt_tokens", "the initial prompt is empty: prompt_tokens + prefix "
                               "tokens must be >= 1")
        if self.turns[0].append_tokens:
            raise _field_error("turns[0].append_tokens", "must be 0 (the initial prompt covers turn 0)")
        last = self.turns[-1]
        if last.tool_s or last.tool or last.tool_cmd:
            raise _field_error(f"turns[{len(self.turns) - 1}]", "the last turn has no tool after it "
                               "(tool_s must be 0, tool and tool_cmd null)")
        n = self.initial_tokens
        for k, t in enumerate(self.turns):
            if not k:
                if t.compact is not None:
                    raise _field_error("turns[0].compact", "turn 0 cannot compact (there is no earlier context)")
                continue
            before = n + self.turns[k - 1].output_tokens
            if t.compact is not None:
                if t.compact.keep_tokens > before:
                    raise _field_error(f"turns[{k}].compact.keep_tokens",
                                       f"{t.compact.keep_tokens} but the context before turn {k} has {before} "
                                       f"tokens (allowed 0..{before})")
                n = t.compact.keep_tokens + t.compact.summary_tokens + t.append_tokens
                if n < 1:
                    raise _field_error(f"turns[{k}]", "the compacted prompt is empty: keep_tokens + "
                                       "summary_tokens + append_tokens must be >= 1")
            else:
                n = before + t.append_tokens
        for i, c in enumerate(self.children):
            if c.after_turn >= len(self.turns):
                raise _field_error(f"children[{i}].after_turn",
                                   f"{c.after_turn} but the workflow has {len(self.turns)} turns "
                                   f"(allowed 0..{len(self.turns) - 1})")
        return self

    # ------------------------------------------------------------------ helpers
    @property
    def initial_tokens(self) -> int:
        return self.prompt_tokens + sum(s.tokens for s in self.prefix)

    def walk(self) -> Iterator[Workflow]:
        """This workflow and all its descendants, depth first."""
        yield self
        for c in self.children:
            yield from c.workflow.walk()

    def first_prompt_tokens(self) -> int:
        return self.initial_tokens

    def turn_tokens(self) -> Iterator[tuple[int, int, int | None, int]]:
        for t in self.turns:
            c = t.compact
            yield (t.output_tokens, t.append_tokens, None if c is None else c.keep_tokens,
                   0 if c is None else c.summary_tokens)

    def uses_compaction(self) -> bool:
        """Whether this workflow or a descendant uses schema v2's ``compact``."""
        return any(t.compact is not None for w in self.walk() for t in w.turns)


class Child(_Strict):
    """A sub-agent started after parent turn ``after_turn``."""

    after_turn: int = Field(ge=0, description="index of the parent turn after which the child starts")
    parent_waits: bool = Field(default=True,
                               description="the parent's next turn waits for the child to finish")
    workflow: Workflow


Workflow.model_rebuild()


class WorkloadLine(Workflow):
    """A top-level line: a root workflow plus the versioned ``schema`` field."""

    schema_: Literal["mars_workload_v1", "mars_workload_v2"] = Field(alias="schema")

    @model_validator(mode="after")
    def _check_version(self) -> WorkloadLine:
        if self.schema_ == SCHEMA_V1:
            for w in self.walk():
                for k, t in enumerate(w.turns):
                    if t.compact is not None:
                        where = "" if w is self else f"workflow {w.workflow_id!r}: "
                        raise _field_error(f"turns[{k}].compact", f"{where}needs schema {SCHEMA_V2!r} "
                                           f"(this line says {SCHEMA_V1!r})")
        return self


# ---------------------------------------------------------------------- errors and loading
def _loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith("function-"):
            continue
        else:
            name = "schema" if part == "schema_" else str(part)
            out += f".{name}" if out else name
    return out


def error_from_validation(path: str | Path, line: int | None, e: ValidationError) -> WorkloadError:
    """The first pydantic error as a WorkloadError (the rest are counted in the message)."""
    errs = e.errors(include_url=False)
    first = errs[0]
    msg = first["msg"]
    msg = msg.removeprefix("Value error, ")
    if first["type"] == "literal_error":
        msg += f" (got {first.get('input')!r})"
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more error(s))"
    loc = _loc(first["loc"])
    extra = (first.get("ctx") or {}).get("field") if first["type"] == "workload_field" else None
    if extra:
        loc = f"{loc}.{extra}" if loc else extra
    return WorkloadError(path, line, loc or None, msg)


def iter_json_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank, non-``#`` line; errors name file and line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such workload file")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                s = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise WorkloadError(path, lineno, None, f"invalid UTF-8 at byte {e.start} of the line") from None
            if not s or s.startswith("#"):
                continue
            obj = load_json(s, path, lineno)
            if not isinstance(obj, dict):
                raise WorkloadError(path, lineno, None,
                                    f"each line must be a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def load_json(text: str, path: str | Path, line: int | None = None) -> Any:
    """``json.loads`` whose every failure (syntax, nesting deeper than Python recurses) is a
    WorkloadError naming file and line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(path, line if line is not None else e.lineno, None,
                            f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise WorkloadError(path, line, None, "JSON nested too deeply") from None
    except ValueError as e:
        # Python refuses to convert an integer literal of more than sys.get_int_max_str_digits()
        # digits; json reports it without a position, so find the literal.
        m = _LONG_INT.search(text)
        if m is None:
            raise WorkloadError(path, line, None, f"invalid JSON: {e}") from None
        lineno = text.count("\n", 0, m.start()) + 1
        col = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
        raise WorkloadError(path, line if line is not None else lineno, None,
                            f"invalid JSON: an integer of {m.end() - m.start()} digits at column {col} "
                            f"(at most {_MAX_INT_DIGITS} allowed)") from None


#: The longest integer literal Python converts (``sys.get_int_max_str_digits()``, 4300 by default).
_MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300
_LONG_INT = re.compile(r"\d{%d,}" % (_MAX_INT_DIGITS + 1))


def _depth(obj: dict[str, Any]) -> int:
    """How deep ``children`` nest below ``obj`` (iterative: safe on hostile input)."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        kids = node.get("children") if isinstance(node, dict) else None
        if isinstance(kids, list) and d <= MAX_DEPTH:
            stack.extend((c.get("workflow"), d + 1) for c in kids if isinstance(c, dict))
    return deepest


def parse_line(obj: dict[str, Any], path: str | Path = "<memory>", line: int | None = None) -> WorkloadLine:
    """Validate one decoded line."""
    schema = obj.get("schema")
    if schema == MAS_TASK_V1:
        raise WorkloadError(path, line, "schema",
                            "this is a mas_task_v1 (live-agent) task; load it with "
                            "vllm_mars.workload.mas_task.load_tasks")
    if schema is None:
        raise WorkloadError(path, line, "schema", f"missing; expected {SCHEMA_V2!r} (or {SCHEMA_V1!r})")
    if schema not in WORKLOAD_SCHEMAS:
        raise WorkloadError(path, line, "schema",
                            f"unsupported schema {str(schema)[:80]!r}; allowed: {SCHEMA_V1!r}, {SCHEMA_V2!r}, "
                            f"{MAS_TASK_V1!r}")
    if _depth(obj) > MAX_DEPTH:
        raise WorkloadError(path, line, "children", f"sub-agents nested more than {MAX_DEPTH} levels deep")
    try:
        return WorkloadLine.model_validate(obj)
    except ValidationError as e:
        raise error_from_validation(path, line, e) from None


def load_workload(path: str | Path) -> list[WorkloadLine]:
    """Read and validate a schema-v1/v2 JSONL file. Workflow ids must be unique (children included)."""
    out: list[WorkloadLine] = []
    seen: dict[str, int] = {}
    for lineno, obj in iter_json_lines(path):
        wf = parse_line(obj, path, lineno)
        for w in wf.walk():
            if w.workflow_id in seen:
                raise WorkloadError(path, lineno, "workflow_id",
                                    f"duplicate id {w.workflow_id!r} (first on line {seen[w.workflow_id]})")
            seen[w.workflow_id] = lineno
        out.append(wf)
    if not out:
        raise WorkloadError(path, None, None, "the workload file has no workflows")
    return out


def dump_line(wf: Workflow) -> str:
    """One JSONL line (with the ``schema`` field) for a workflow; defaults and nulls omitted. The
    schema is the oldest that expresses the workflow: v1 unless it (or a child) compacts."""
    data = wf.model_dump(mode="json", by_alias=True, exclude_defaults=True, exclude_none=True)
    data.pop("schema", None)
    schema = SCHEMA_V2 if wf.uses_compaction() else SCHEMA_V1
    return json.dumps({"schema": schema, **data}, separators=(",", ":"))


def write_workload(path: str | Path, workflows: Iterable[Workflow]) -> int:
    """Write workflows as schema-v1/v2 JSONL (streamed: one line per workflow as it comes);
    returns the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for wf in workflows:
            f.write(dump_line(wf) + "\n")
            n += 1
    return n


def sniff_schema(path: str | Path) -> str | None:
    """The ``schema`` field of the first record (``mars_workload_v1``, ``mas_task_v1``, ...)."""
    for _, obj in iter_json_lines(path):
        s = obj.get("schema")
        return s if isinstance(s, str) else None
    return None
