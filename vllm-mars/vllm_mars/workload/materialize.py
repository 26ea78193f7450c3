"""Turn a schema-v1/v2 workload into token-id plans the driver sends as prompts.

Token ids are drawn from ``[FIRST_TOKEN_ID, vocab_size)`` by a generator seeded from
``(seed, key)`` with a stable hash, so the same workload + seed gives the same ids on every
machine, and a segment key shared by several workflows gives them identical prefix ids (real
prefix-cache sharing in vLLM). Unkeyed segments are keyed by the workflow id and their position,
so they are unique to their workflow.

The driver builds turn k's prompt as ``prompt_0 = initial_ids`` and
``prompt_k = prompt_{k-1} + (actual output ids of call k-1) + turns[k].appended_ids``, or, when
turn k compacts (schema v2), ``prompt_k = context[:keep] + turns[k].summary_ids +
turns[k].appended_ids`` with ``context = prompt_{k-1} + output ids``: the kept head still hits the
prefix cache, the summary (drawn per workflow and turn, so unique) misses, as a real compaction does.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_mars.workload.schema import CallLengths, Workflow, load_workload

#: Ids below this are left alone (pad/bos/eos live there in small vocabularies).
FIRST_TOKEN_ID = 3


@dataclass(frozen=True)
class TurnPlan:
    """One call of a workflow plan."""

    #: Token ids appended to the context BEFORE this call (the previous tool's output); [] on turn 0.
    appended_ids: list[int]
    #: Tokens this call generates (the driver uses ignore_eos + max_tokens=output_tokens).
    output_tokens: int
    #: Simulated tool time AFTER this call, seconds (0 for the last turn).
    tool_s: float
    #: Tool called after this call (sent as ``mars_tool`` on the NEXT call).
    tool_name: str | None
    #: Shell command for real tool execution, if any.
    tool_cmd: str | None
    #: Compaction before this call (schema v2): the prompt restarts as the first ``keep_tokens``
    #: ids of the previous context + ``summary_ids`` (then ``appended_ids``). None: no compaction.
    keep_tokens: int | None = None
    summary_ids: list[int] = field(default_factory=list)

    def next_prompt(self, context: list[int]) -> list[int]:
        """This call's prompt from the previous call's context (its prompt + output ids)."""
        if self.keep_tokens is None:
            return context + self.appended_ids
        return context[: self.keep_tokens] + self.summary_ids + self.appended_ids


@dataclass(frozen=True)
class WorkflowPlan(CallLengths):
    """A workflow with materialized token ids; children are nested plans."""

    workflow_id: str
    #: Root workflow id (== workflow_id for roots).
    root_id: str
    parent_id: str | None
    #: Offset from the run start; None lets the driver's arrival process decide. Always None
    #: for children, which start when their parent reaches ``after_turn``.
    arrival_s: float | None
    #: The first call's prompt (shared prefix ids + task ids).
    initial_ids: list[int]
    turns: list[TurnPlan]
    #: (index of the parent turn after which the child starts, child plan).
    children: list[tuple[int, WorkflowPlan]] = field(default_factory=list)
    #: For a child: whether the parent's next turn waits for it (a sub-agent called as a tool).
    parent_waits: bool = True
    source: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_estimate(self) -> int:
        """Prompt tokens of the first call (what admission budgets for)."""
        return len(self.initial_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def total_output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def total_tool_s(self) -> float:
        return sum(t.tool_s for t in self.turns)

    def first_prompt_tokens(self) -> int:
        return len(self.initial_ids)

    def turn_tokens(self) -> Iterator[tuple[int, int, int | None, int]]:
        for t in self.turns:
            yield t.output_tokens, len(t.appended_ids), t.keep_tokens, len(t.summary_ids)

    def walk(self):
        """This plan and all descendants, depth first."""
        yield self
        for _, c in self.children:
            yield from c.walk()


class TokenSource:
    """Deterministic token ids per (seed, key); keyed segments are cached (they repeat)."""

    def __init__(self, vocab_size: int = 4096, seed: int = 0):
        if vocab_size <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID + 1}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        # Drawing from a list of int objects makes the result share them (8 bytes per id).
        self._population = list(range(FIRST_TOKEN_ID, vocab_size))
        self._cache: dict[tuple[str, int], list[int]] = {}

    def ids(self, key: str, n: int) -> list[int]:
        """``n`` ids for ``key``; the same (seed, key, n) always gives the same list."""
        digest = hashlib.blake2b(f"{self.seed}\x00{key}".encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "little")).choices(self._population, k=n)

    def shared(self, key: str, n: int) -> list[int]:
        got = self._cache.get((key, n))
        if got is None:
            got = self._cache[(key, n)] = self.ids(f"shared\x00{key}", n)
        return got


def materialize(wf: Workflow, tokens: TokenSource, root_id: str | None = None,
                parent_id: str | None = None, parent_waits: bool = True) -> WorkflowPlan:
    """One workflow (and its children) as a plan."""
    wid = wf.workflow_id
    initial: list[int] = []
    for s in wf.prefix:
        initial += tokens.shared(s.key, s.tokens) if s.key else tokens.ids(f"{wid}\x00prefix{len(initial)}", s.tokens)
    if wf.prompt_tokens:
        initial += tokens.ids(f"{wid}\x00task", wf.prompt_tokens)
    turns = [
        TurnPlan(
            appended_ids=tokens.ids(f"{wid}\x00turn{k}", t.append_tokens) if t.append_tokens else [],
            output_tokens=t.output_tokens,
            tool_s=float(t.tool_s),
            tool_name=t.tool,
            tool_cmd=t.tool_cmd,
            keep_tokens=None if t.compact is None else t.compact.keep_tokens,
            summary_ids=(tokens.ids(f"{wid}\x00summary{k}", t.compact.summary_tokens)
                         if t.compact is not None and t.compact.summary_tokens else []),
        )
        for k, t in enumerate(wf.turns)
    ]
    root = root_id or wid
    children = [(c.after_turn, materialize(c.workflow, tokens, root, wid, c.parent_waits))
                for c in wf.children]
    return WorkflowPlan(
        workflow_id=wid, root_id=root, parent_id=parent_id,
        arrival_s=wf.arrival_s if parent_id is None else None,
        initial_ids=initial, turns=turns, children=children, parent_waits=parent_waits,
        source=wf.source, meta=dict(wf.meta),
    )


def cycle_roots(roots: list, n: int | None, rename) -> list:
    """The first ``n`` of ``roots``, cycling the list when ``n`` is larger: the k-th repeat of a root
    is ``rename(root, f"~{k}")``. The one cycling rule for workflows and plans alike."""
    if not roots:
        raise ValueError("the workload has no workflows")
    if n is None or n <= len(roots):
        return list(roots[: n or len(roots)])
    return [*roots, *(rename(roots[i % len(roots)], f"~{i // len(roots)}") for i in range(len(roots), n))]


def _renamed_workflow(wf: Workflow, suffix: str) -> Workflow:
    kids = [c.model_copy(update={"workflow": _renamed_workflow(c.workflow, suffix)}) for c in wf.children]
    return wf.model_copy(update={"workflow_id": wf.workflow_id + suffix, "children": kids})


def cycle_workflows(workflows: list[Workflow], n: int | None) -> list[Workflow]:
    """The first ``n`` roots, cycling the file with ids suffixed ``~k`` on the k-th repeat (children
    too). Done before token ids are drawn, so a repeat is another session of the same shape: its
    task and turn tokens are its own (drawn per workflow id) and only keyed prefix segments are
    shared, as with any two workflows. (Repeats with the original's ids would share their whole
    context through the prefix cache: no KV of their own.)"""
    return cycle_roots(workflows, n, _renamed_workflow)


def materialize_all(workflows: list[Workflow], vocab_size: int = 4096, seed: int = 0) -> list[WorkflowPlan]:
    tokens = TokenSource(vocab_size, seed)
    return [materialize(wf, tokens) for wf in workflows]


def check_context(path: str | Path, workflows: list[Workflow], max_model_len: int) -> None:
    """Every call of every workflow must fit ``max_model_len`` (checked before any id is drawn)."""
    for root in workflows:
        for w in root.walk():
            need = w.peak_context_tokens()
            if need > max_model_len:
                raise ValueError(f"{path}: workflow {w.workflow_id!r} reaches {need} tokens of context, above "
                                 f"max_model_len={max_model_len}; raise --max-model-len, scale the workload "
                                 f"down, or convert it with compaction (mars convert weka --max-context)")


def load_plans(path: str | Path, vocab_size: int = 4096, seed: int = 0,
               max_model_len: int | None = None, num_workflows: int | None = None) -> list[WorkflowPlan]:
    """Load a schema-v1/v2 JSONL workload (errors name file, line, field) and materialize token ids;
    with ``max_model_len``, a workflow that cannot fit is an error before anything is materialised;
    with ``num_workflows``, the first that many roots (the file cycled, see ``cycle_workflows``)."""
    workflows = load_workload(path)
    if max_model_len is not None:
        check_context(path, workflows, max_model_len)
    return materialize_all(cycle_workflows(workflows, num_workflows), vocab_size=vocab_size, seed=seed)
