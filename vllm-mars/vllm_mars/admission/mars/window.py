"""The AIMD window of the MARS admission controller and the pressure that drives it.

The window ``W`` on active roots is updated at most once per ``interval_s``: x``dec_factor`` under
pressure, +``inc`` when healthy. Pressure is

* **telemetry** older than ``stale_s``;
* **KV**: under the cost rule, the measured share of engine time spent recomputing lost KV (preempted
  tokens and evicted blocks, priced by the cost model) at ``rebuild_share_high``, while the pool
  keeps ``window_min`` of the contexts the roots will have (where it keeps fewer, a smaller window
  saves no context); it decreases from the active count. Under the footprint rule, KV usage at
  ``kv_target`` (cleared at ``kv_low``).

The limit is ``min(W, cpu_cap, kv_cap)``, each >= ``window_min``: ``cpu_cap`` follows the tool
workers (``ceil(workers x cpu_cap_per_worker)``), the CPU plane's only rule (a window decrease on the
tool queue wait and a largest-first order while it was high were measured to add nothing over the
cap, and retired: ``experiments/paper/README.md``, "The CPU-tool cell"); ``kv_cap`` follows KV usage
(footprint rule) or nothing (cost rule: rebuilds drive ``W``).
"""

from __future__ import annotations

import math
from typing import Any

from vllm_mars.admission.base import AdmissionEvent, ControllerBase, Telemetry
from vllm_mars.admission.mars.config import MarsAdmissionConfig
from vllm_mars.costmodel import CostModel


class AimdWindow(ControllerBase):
    """The window and pressure half of :class:`~vllm_mars.admission.mars.MarsAdmissionController`."""

    config: MarsAdmissionConfig
    cost: CostModel | None

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._rebuild_share: float | None = None  # measured share of engine time spent rebuilding
        self._prev_rebuild: tuple[float, int] | None = None  # (ts, cumulative rebuilt tokens)
        self._last_window_update: float | None = None
        self._kv_overloaded = False
        self._stale = False

    # hooks the controller provides
    def _rule(self) -> str:
        raise NotImplementedError

    def _net_applies(self) -> bool:
        raise NotImplementedError

    def _block_size(self) -> int:
        raise NotImplementedError

    def budget_blocks(self) -> int | None:
        raise NotImplementedError

    def _inputs(self, now: float) -> dict:
        raise NotImplementedError

    def _cost_mode(self) -> bool:
        """The cost rule with a measured rebuild share (else KV usage drives the window)."""
        return self._rule() == "cost" and self._rebuild_share is not None

    def _measure_rebuilds(self, t: Telemetry) -> None:
        """Share of engine time spent recomputing lost KV (preempted tokens + evicted blocks,
        priced per token by the cost model), an EMA over readings at least ``interval_s`` apart."""
        if self.cost is None or t.recomputed_tokens is None:
            return
        tokens = t.recomputed_tokens + (t.kv_blocks_removed or 0) * (t.block_size or self._block_size())
        prev = self._prev_rebuild
        if prev is None:
            self._prev_rebuild = (t.ts, tokens)
            self._rebuild_share = 0.0  # measurable from now on; nothing rebuilt yet
            return
        dt = t.ts - prev[0]
        if dt < self.config.interval_s:
            return
        share = min(1.0, max(0, tokens - prev[1]) * self.cost.prefill_s_per_token / dt)
        old = self._rebuild_share
        self._rebuild_share = share if old is None else 0.7 * old + 0.3 * share
        self._prev_rebuild = (t.ts, tokens)

    def _cpu_backlog_ratio(self) -> float | None:
        """Tool calls in flight (queued ones included) per tool worker, for the decision events."""
        t = self._tel
        if t is None or t.tools_in_flight is None:
            return None
        return t.tools_in_flight / max(1, t.tool_workers or 1)

    def _caps(self) -> tuple[int, int]:
        cfg, t = self.config, self._tel
        lo, hi = cfg.window_min, cfg.window_max
        cpu_cap = hi
        if t is not None and t.tool_workers:
            cpu_cap = min(hi, max(lo, math.ceil(t.tool_workers * cfg.cpu_cap_per_worker)))
        usage = self._usage()
        if self._stale:
            kv_cap = lo
        elif self._cost_mode():
            kv_cap = hi  # the AIMD window reacts to measured rebuilds
        elif usage is None or usage <= cfg.kv_low:
            kv_cap = hi
        elif usage >= cfg.kv_target:
            kv_cap = lo
        else:
            frac = (usage - cfg.kv_low) / (cfg.kv_target - cfg.kv_low)
            kv_cap = min(hi, max(lo, round(hi - frac * (hi - lo))))
        return cpu_cap, kv_cap

    def _set_pressure(self, now: float, kind: str, state: bool, inputs: dict) -> None:
        attr = {"kv": "_kv_overloaded", "telemetry": "_stale"}[kind]
        if getattr(self, attr) != state:
            setattr(self, attr, state)
            self._events.append(AdmissionEvent(now, "admission_pressure",
                                               {"controller": self.name, "kind": kind, "overloaded": state,
                                                **inputs}))

    def _update_pressure(self, now: float) -> None:
        cfg, t = self.config, self._tel
        stale = t is not None and now - t.ts > cfg.stale_s
        kv = self._kv_overloaded
        usage = self._usage()
        if self._cost_mode():
            # Full KV is fine while rebuilds are cheap: pressure is measured rebuild time.
            share = self._rebuild_share
            applies = self._net_applies()
            if share >= cfg.rebuild_share_high and applies:
                kv = True
            elif share <= cfg.rebuild_share_low or not applies:
                kv = False
        elif usage is not None and not stale:
            if usage >= cfg.kv_target:
                kv = True
            elif usage <= cfg.kv_low:
                kv = False
        if (stale, kv) == (self._stale, self._kv_overloaded):
            return  # the hot path: nothing changed, build no event
        inputs = {**self._inputs(now), "rebuild_share": self._rebuild_share}
        self._set_pressure(now, "telemetry", stale, inputs)
        self._set_pressure(now, "kv", kv, inputs)

    def _update_window(self, now: float) -> None:
        cfg = self.config
        if self._last_window_update is not None and now - self._last_window_update < cfg.interval_s - 1e-9:
            return
        self._last_window_update = now
        if not self._telemetry_usable() and self._tel is None:
            return  # nothing to react to; the fixed no-telemetry window applies
        prev = self.window
        usage = self._usage()
        budget = self.budget_blocks()
        overloaded = self._kv_overloaded or self._stale
        if overloaded:
            base = self.window
            if self._cost_mode() and self._kv_overloaded:
                # Measured thrashing: decrease from what is in flight (a window above the active
                # count would not stop a single admission).
                base = min(base, max(len(self._active), 1))
            w = max(cfg.window_min, math.floor(base * cfg.dec_factor))
        elif self._cost_mode() or ((usage is None or usage <= cfg.kv_low) and (budget is None or budget > 0)):
            w = min(cfg.window_max, self.window + cfg.inc)
        else:
            w = self.window
        cpu_cap, kv_cap = self._caps()
        w = max(cfg.window_min, min(w, cpu_cap, kv_cap))
        self.window = w
        if w != prev:
            self._events.append(AdmissionEvent(now, "admission_window", {
                "controller": self.name, "prev": prev, "new": w, "cpu_cap": cpu_cap, "kv_cap": kv_cap,
                "overloaded": overloaded, "kv_overloaded": self._kv_overloaded,
                "stale": self._stale, "kv_budget_blocks": budget,
                **self._inputs(now)}))

    def limit(self) -> int:
        """Active-root limit now."""
        if not self._telemetry_usable():
            return min(self.config.no_telemetry_window, self.config.window_max)
        cpu_cap, kv_cap = self._caps()
        return max(self.config.window_min, min(self.window, cpu_cap, kv_cap))
