"""CONCUR admission (Chen et al., arXiv 2601.22705): agent-level AIMD on the number of active
workflows from KV utilisation and prefix-cache hit rate. Pure Python, no vllm import.

What we know of CONCUR is second hand (the abstract, a blog and reviews; no code was found): an
additive increase while KV utilisation is below ``u_low`` (0.2), a multiplicative decrease when it
is above ``u_high`` (0.5) *and* the prefix hit rate falls; hold in between. The thresholds are
reported numbers, not verified ones.

Constants check (2026-12-05, for issue 31): searched the stored public pages, code and docs for the
paper's text and code. The paper (arXiv 2601.22705v1, HTML title "Concur: Proactive Agent-Level
Admission Control for Efficient Agentic Batch Inference", https://arxiv.org/html/2601.22705v1) is
stored only up to its introduction; its authors' blog (https://yezhisheng.me/post/concur/) and the
reviews describe the loop (AIMD on the number of active agents from KV utilisation and hit rate)
without constants; no repository in the index implements it. So ``u_low`` = 0.2 and ``u_high`` = 0.5
stay the secondary-source numbers (a summary of the paper's threshold study: 0.8 thrashes), and
``inc`` = 1 / ``dec_factor`` = 0.5 are TCP's AIMD constants, our choice. None of them could be
confirmed or refuted against the primary source; they are unchanged. Admission itself is plain arrival order within the window
(CONCUR has no footprint model). Our choices where the sources are silent: a hit rate that is
unknown counts as falling (conservative); missing telemetry gives a small fixed window; stale
telemetry (older than ``stale_s``) counts as high utilisation with a falling hit rate.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from vllm_mars.admission.base import AdmissionEvent, ControllerBase, WindowConfig, register_controller

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConcurConfig(WindowConfig):
    """Knobs of the CONCUR controller (reported defaults, second hand); the window fields,
    ``interval_s``, ``stale_s`` and ``no_telemetry_window`` come from :class:`WindowConfig`."""

    #: Additive increase per control interval while utilisation < ``u_low``.
    inc: int = 1
    #: Multiplicative decrease factor when utilisation > ``u_high`` and the hit rate falls.
    dec_factor: float = 0.5
    #: KV utilisation below which the window grows.
    u_low: float = 0.2
    #: KV utilisation above which the window may shrink.
    u_high: float = 0.5
    #: A hit rate this much below the previous reading counts as falling.
    hit_drop_tol: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = self._bad
        if self.inc < 0:
            raise bad("inc", ">= 0")
        if not 0.1 <= self.dec_factor <= 0.99:
            raise bad("dec_factor", "in [0.1, 0.99]")
        if not 0 <= self.u_low < self.u_high <= 1:
            raise bad("u_low", f"in [0, u_high={self.u_high}) with u_high <= 1")
        if self.hit_drop_tol < 0:
            raise bad("hit_drop_tol", ">= 0")


@register_controller
class ConcurController(ControllerBase):
    """AIMD window on active workflows, arrival-order admission."""

    name = "concur"
    config_cls = ConcurConfig
    config: ConcurConfig

    def __init__(self, config: ConcurConfig | None = None) -> None:
        super().__init__(config)
        self._prev_hit: float | None = None
        self._last_update: float | None = None
        self._stale = False

    def _update(self, now: float) -> None:
        cfg, t = self.config, self._tel
        if t is None or (self._last_update is not None and now - self._last_update < cfg.interval_s - 1e-9):
            return
        self._last_update = now
        stale = now - t.ts > cfg.stale_s
        usage = self._usage()
        hit = t.prefix_hit_rate
        falling = hit is None or (self._prev_hit is not None and hit < self._prev_hit - cfg.hit_drop_tol)
        if hit is not None and not stale:
            self._prev_hit = hit
        prev = self.window
        if stale or (usage is not None and usage > cfg.u_high and falling):
            self.window = max(cfg.window_min, math.floor(self.window * cfg.dec_factor))
            reason = "stale" if stale else "decrease"
        elif usage is not None and usage < cfg.u_low:
            self.window = min(cfg.window_max, self.window + cfg.inc)
            reason = "increase"
        else:
            reason = "hold"
        if self.window != prev:
            self._events.append(AdmissionEvent(now, "admission_window", {
                "controller": self.name, "prev": prev, "new": self.window, "reason": reason,
                "kv_usage": usage, "prefix_hit_rate": hit, "hit_falling": falling, "stale": stale,
                "telemetry_age_s": round(now - t.ts, 6)}))
        if stale != self._stale:
            self._stale = stale
            self._events.append(AdmissionEvent(now, "admission_pressure", {
                "controller": self.name, "kind": "telemetry", "overloaded": stale,
                "telemetry_age_s": round(now - t.ts, 6)}))

    def limit(self) -> int:
        if self._usage() is None:
            return min(self.config.no_telemetry_window, self.config.window_max)
        return self.window

    def tick(self, now: float) -> list[str]:
        self._update(now)
        slots = self.limit() - len(self._active)
        out: list[str] = []
        while slots > 0 and self._queue:
            wf, root = next(iter(self._queue.items()))
            self._admit(root, now)
            slots -= 1
            out.append(wf)
            self._events.append(AdmissionEvent(now, "admission_admit", {
                "controller": self.name, "workflow": wf, "mode": "fcfs", "limit": self.limit(),
                "window": self.window, "kv_usage": self._usage(),
                "prefix_hit_rate": None if self._tel is None else self._tel.prefix_hit_rate,
                "active": len(self._active), "queued": len(self._queue),
                "waited_s": round(now - root.arrival, 6)}))
        return out
