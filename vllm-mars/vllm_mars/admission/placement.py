"""Backends behind the sidecar and where a new root goes.

A :class:`Backend` is one vLLM server: its /metrics reader, its upstream connection pool, the
roots placed on it, and whether it is up (last poll good and fresh). :class:`Placement` puts a
new root on the live backend with the most KV budget: free blocks above the guard margin of the
controller's own ``kv_target`` (the one it admits by), minus the blocks the controller has
promised to roots already placed there that the backend's telemetry cannot show yet. Promises are
counted in the controller only (:meth:`ControllerBase.promised_blocks`); ties go to the backend
with fewer roots. A root stays on its backend for life (its KV is there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm_mars.admission.base import Telemetry
from vllm_mars.admission.telemetry import HttpTelemetry, TelemetryState
from vllm_mars.admission.upstream import UpstreamPool
from vllm_mars.clock import Clock

logger = logging.getLogger(__name__)

#: the guard-margin target used when the controller has none (``none``, ``concur``)
DEFAULT_KV_TARGET = 0.9


class Backend:
    """One upstream vLLM server."""

    __slots__ = ("pool", "roots", "telemetry", "up", "url")

    def __init__(self, url: str, *, telemetry_timeout_s: float, telemetry_stale_s: float,
                 connect_timeout_s: float, clock: Clock | None = None) -> None:
        self.url = url.rstrip("/")
        self.telemetry = HttpTelemetry(self.url, timeout_s=telemetry_timeout_s, stale_s=telemetry_stale_s,
                                       clock=clock)
        self.pool = UpstreamPool(self.url, connect_timeout=connect_timeout_s)
        self.roots: set[str] = set()
        self.up = False

    def refresh(self) -> bool:
        """Recompute ``up`` (last poll good and fresh); cached so the hot path reads a bool."""
        self.up = self.telemetry.status().state is TelemetryState.OK
        return self.up


def pooled_telemetry(backends: Sequence[Backend]) -> Telemetry | None:
    """The live backends' readings summed into one Telemetry (None when none is live). Its time is
    the oldest reading's, so the controller ages the pool by its stalest member."""
    tels = [b.telemetry.last for b in backends if b.up and b.telemetry.last is not None]
    if not tels:
        return None
    free = sum(t.free_blocks or 0 for t in tels)
    total = sum(t.total_blocks or 0 for t in tels)

    def summed(name: str) -> int | None:  # known only when every live backend reports it
        vals = [getattr(t, name) for t in tels]
        return None if any(v is None for v in vals) else sum(vals)

    return Telemetry(ts=min(t.ts for t in tels), free_blocks=free, total_blocks=total,
                     block_size=tels[0].block_size, kv_usage=(1 - free / total) if total else None,
                     prefix_hit_rate=tels[0].prefix_hit_rate if len(tels) == 1 else None,
                     running=summed("running"), waiting=summed("waiting"), preemptions=summed("preemptions"))


class Placement:
    """Chooses the backend of each new root (see the module docstring)."""

    def __init__(self, backends: Sequence[Backend], controller: Any, kv_target: float | None = None) -> None:
        self.backends = list(backends)
        self.controller = controller
        self._kv_target = kv_target

    @property
    def kv_target(self) -> float:
        """The explicit override, else the controller's ``kv_target``, else 0.9."""
        if self._kv_target is not None:
            return self._kv_target
        return float(getattr(getattr(self.controller, "config", None), "kv_target", DEFAULT_KV_TARGET))

    def score(self, b: Backend) -> float:
        """KV budget left on ``b`` for a new root."""
        promised = getattr(self.controller, "promised_blocks", None)
        owed = promised(b.roots) if promised is not None and b.roots else 0
        return b.telemetry.budget_blocks(self.kv_target) - owed

    def place(self, root: str) -> Backend:
        live = [b for b in self.backends if b.up] or self.backends
        best = max(live, key=lambda b: (self.score(b), -len(b.roots)))
        best.roots.add(root)
        return best

    @staticmethod
    def release(root: str, b: Backend | None) -> None:
        if b is not None:
            b.roots.discard(root)
