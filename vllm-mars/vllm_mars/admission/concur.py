"""CONCUR admission (Chen et al., "CONCUR: High-Throughput Agentic Batch Inference of LLM via
Congestion-Based Concurrency Control", ICML 2026, PMLR 306:17881-17891; arXiv 2601.22705): AIMD on
the number of active workflows from KV utilisation and prefix-cache hit rate. Pure Python, no vllm
import.

The rule is the paper's Eq. 1 (section 4.3) with its section 5.1 settings, the same for every model
and workload there: with ``U`` the KV utilisation and ``H`` the cache hit rate,

- ``U < u_low`` (0.2): window + ``inc`` (alpha = 2);
- ``U > u_high`` (0.5) and ``H < hit_thresh`` (0.2): window x ``dec_factor`` (beta = 0.5);
- otherwise hold (high utilisation with a healthy hit rate keeps running).

The signals are the instantaneous readings (no smoothing). Congestion is high utilisation with a
low hit rate: a full cache that misses. The controller gates agents (admit / pause / resume at
generation-step and tool-call boundaries), not requests.

Constants check (issue 31, 2026-12-05). Until then this rule had ``inc`` 1 and decreased when the hit
rate *fell* (by more than 0.01 between readings), from reviews of the paper. The primary source:
https://proceedings.mlr.press/v306/chen26fs.html (PDF
https://raw.githubusercontent.com/mlresearch/v306/main/assets/chen26fs/chen26fs.pdf, listed in the
volume's record ``mlresearch/v306:_posts/2026-09-29-chen26fs.md``) = https://arxiv.org/html/2601.22705v1
(v1, 30 Jan 2026; sections 4.3 and 5.1 "Hyperparameter Configuration"; appendix A.1, Table 3: U_high
0.5 -> 0.6 costs little, 0.8 is 4-5x slower). Searched: the search tool's ``pages`` (the arXiv HTML
is stored only through section 1; the authors' blog https://yezhisheng.me/post/concur/ and review
pages describe the loop without numbers), ``docs`` and ``issues`` (nothing), ``code`` and
``find_string`` ("middle-phase thrashing", "2601.22705", "Concur: Proactive Agent-Level", "H_thresh",
"Cache-Aware Admission Control"), ``find_repos`` "concur" and ``fetch`` of ``mlresearch/v306`` (no
snapshot to be had). The rule and its five numbers come from two independent quotations of the paper
text found that way: a close-reading note of the arXiv v1 PDF (Eq. 1 written out, section 5.1,
Table 3), and a related-work note that checked the PMLR PDF's sections 4.2-4.3 against arXiv section
4.3 (alpha 2, beta 0.5, U_low 0.2, U_high 0.5, H_thresh 0.2; admit / pause / resume at agent
generation and tool boundaries). They agree; neither gives an update period or an initial window.
No code release: none in the code index, and the paper lists none.

Our choices where the paper is silent or our contract differs: the control interval
(``interval_s``), the window bounds and start (``window_min`` 1, ``window_max`` 30, ``window_init``);
a hit rate that is unknown counts as low (conservative); missing telemetry gives a small fixed
window; stale telemetry (older than ``stale_s``) counts as congestion. CONCUR also pauses admitted
agents (at a generation-step boundary) to keep the active set within the window; ours admits roots
only (the admission contract, ``base.py``), so a smaller window holds new roots until active ones
finish. Admission itself is plain arrival order within the window (CONCUR has no footprint model).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from vllm_mars.admission.base import AdmissionEvent, ControllerBase, WindowConfig, register_controller

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConcurConfig(WindowConfig):
    """Knobs of the CONCUR controller (defaults: the paper's section 5.1 settings); the window
    fields, ``interval_s``, ``stale_s`` and ``no_telemetry_window`` come from :class:`WindowConfig`."""

    #: Additive increase (alpha) per control interval while utilisation < ``u_low``.
    inc: int = 2
    #: Multiplicative decrease factor (beta) when utilisation > ``u_high`` and the hit rate < ``hit_thresh``.
    dec_factor: float = 0.5
    #: KV utilisation below which the window grows.
    u_low: float = 0.2
    #: KV utilisation above which the window may shrink.
    u_high: float = 0.5
    #: Prefix-cache hit rate below which high utilisation is congestion (the paper's H_thresh).
    hit_thresh: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = self._bad
        if self.inc < 0:
            raise bad("inc", ">= 0")
        if not 0.1 <= self.dec_factor <= 0.99:
            raise bad("dec_factor", "in [0.1, 0.99]")
        if not 0 <= self.u_low < self.u_high <= 1:
            raise bad("u_low", f"in [0, u_high={self.u_high}) with u_high <= 1")
        if not 0 <= self.hit_thresh <= 1:
            raise bad("hit_thresh", "in [0, 1]")


@register_controller
class ConcurController(ControllerBase):
    """AIMD window on active workflows, arrival-order admission."""

    name = "concur"
    config_cls = ConcurConfig
    config: ConcurConfig

    def __init__(self, config: ConcurConfig | None = None) -> None:
        super().__init__(config)
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
        hit_low = hit is None or hit < cfg.hit_thresh
        prev = self.window
        if stale or (usage is not None and usage > cfg.u_high and hit_low):
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
                "kv_usage": usage, "prefix_hit_rate": hit, "hit_low": hit_low, "stale": stale,
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
