"""Online learning of tool return gaps: the time from a call's end to its workflow's next call.

Shared by the policies that decide on KV across a tool call (mars retention, continuum,
continuum_dy, infercept). No oracle: a gap is observed only when the workflow actually returns.
Memory is bounded: the last ``window`` gaps per key (tool name, workflow id) and a bounded number
of keys (least recently used keys are forgotten).

A gap is learned under the tool that ran in it, and looked up under the same tool
(:func:`gap_tool`): the tool the finished call is about to run when known (the engine's tool-call
parser, else the client's ``mars_next_tool``), else the tool its previous turn ran (``mars_tool``).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any


def gap_tool(call: Any) -> str | None:
    """The tool whose return gaps predict ``call``'s next gap (a :class:`CallView`, duck-typed): the
    tool the call is about to run when known (``call.next_tool``), else the tool its previous turn
    ran (``mars_tool``), else None (policies then fall back to the workflow's own gaps, then all)."""
    return call.next_tool or call.workflow.tool


class GapSamples:
    """The last ``window`` gaps of one key, with a sorted copy for CDF queries."""

    __slots__ = ("_recent", "_sorted", "_sum")

    def __init__(self, window: int) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self._sum = 0.0

    def add(self, gap: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
            self._sum -= old
        self._recent.append(gap)
        bisect.insort(self._sorted, gap)
        self._sum += gap

    def __len__(self) -> int:
        return len(self._recent)

    @property
    def mean(self) -> float:
        return self._sum / len(self._recent) if self._recent else 0.0

    def cdf(self, tau: float) -> float:
        """Empirical P(gap <= tau)."""
        n = len(self._sorted)
        return bisect.bisect_right(self._sorted, tau) / n if n else 0.0

    def values(self) -> list[float]:
        """Sorted observed gaps."""
        return list(self._sorted)

    def quantile(self, q: float) -> float:
        if not self._sorted:
            return 0.0
        i = min(int(q * len(self._sorted)), len(self._sorted) - 1)
        return self._sorted[i]


class GapTracker:
    """Observes call ends and arrivals; keeps per-tool and per-workflow gap samples.

    Policies call :meth:`call_ended` from ``on_finished`` (non-aborted, not the last step) with the
    call's ``next_tool`` and :meth:`call_arrived` from ``on_arrival`` with the arriving call's
    ``mars_tool``: both name the tool that ran in the gap, the key it is learned under.
    """

    def __init__(self, window: int = 256, max_keys: int = 4096) -> None:
        if window < 1 or max_keys < 1:
            raise ValueError("window and max_keys must be >= 1")
        self.window = window
        self.max_keys = max_keys
        self._by_tool: OrderedDict[str, GapSamples] = OrderedDict()
        self._by_workflow: OrderedDict[str, GapSamples] = OrderedDict()
        self._all = GapSamples(window)
        # workflow -> (end time, tool of the call that ended)
        self._open: OrderedDict[str, tuple[float, str | None]] = OrderedDict()

    def _samples(self, table: OrderedDict[str, GapSamples], key: str) -> GapSamples:
        s = table.get(key)
        if s is None:
            s = table[key] = GapSamples(self.window)
            if len(table) > self.max_keys:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        return s

    def call_ended(self, workflow: str, now: float, tool: str | None = None) -> None:
        """``tool``: the tool the ended call is about to run (its ``next_tool``), when known."""
        self._open[workflow] = (now, tool)
        self._open.move_to_end(workflow)
        if len(self._open) > self.max_keys:
            self._open.popitem(last=False)

    def call_arrived(self, workflow: str, now: float, tool: str | None = None) -> float | None:
        """Record the gap if ``workflow`` had a call end earlier; returns the gap (or None).

        ``tool`` is the tool the arriving call reports (``mars_tool``: the tool its previous turn
        called); it takes precedence over the tool known at the previous call's end.
        """
        ended = self._open.pop(workflow, None)
        if ended is None:
            return None
        gap = max(now - ended[0], 0.0)
        key = tool or ended[1]
        if key:
            self._samples(self._by_tool, key).add(gap)
        self._samples(self._by_workflow, workflow).add(gap)
        self._all.add(gap)
        return gap

    def forget(self, workflow: str) -> None:
        self._open.pop(workflow, None)
        self._by_workflow.pop(workflow, None)

    def samples(self, tool: str | None = None, workflow: str | None = None,
                min_samples: int = 1, tool_first: bool = False) -> GapSamples | None:
        """The most specific samples with at least ``min_samples``: workflow, then tool, then all
        (``tool_first``: tool, then workflow, then all)."""
        order = ((self._by_workflow, workflow), (self._by_tool, tool))
        for table, key in (order[::-1] if tool_first else order):
            if key is not None:
                s = table.get(key)
                if s is not None and len(s) >= min_samples:
                    return s
        return self._all if len(self._all) >= min_samples else None

    def tool_mean(self, tool: str | None, default: float) -> float:
        s = self._by_tool.get(tool) if tool else None
        return s.mean if s else default

    def keys(self) -> tuple[Iterable[str], Iterable[str]]:
        return self._by_tool.keys(), self._by_workflow.keys()

    def tool_samples(self, tool: str | None) -> GapSamples | None:
        """This tool's own samples (no fallback), or None when the tool was never seen."""
        return self._by_tool.get(tool) if tool else None

    def workflow_samples(self, workflow: str | None) -> GapSamples | None:
        """This workflow's own samples (no fallback), or None."""
        return self._by_workflow.get(workflow) if workflow else None

    def all_samples(self) -> GapSamples:
        """Every observed gap (the global pool)."""
        return self._all
