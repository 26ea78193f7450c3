"""The knobs of the MARS admission controller (SPEC section 4), each with its range check.

What the rules do with them: :mod:`vllm_mars.admission.mars` (the package docstring). How each
default was chosen, and the options that were measured and retired: ``docs/history.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mars.admission.base import WindowConfig


@dataclass(frozen=True)
class MarsAdmissionConfig(WindowConfig):
    """Knobs of the MARS admission controller. ``window_init`` (None: ``window_min``, or
    ``window_max`` under the cost rule), ``interval_s``, ``stale_s`` and ``no_telemetry_window``
    come from :class:`WindowConfig`."""

    #: Lower bound of the window; pressure never pushes the limit below this.
    window_min: int = 4
    #: Upper bound of the window. With the cost rule and "life" sizing, KV gates admission and the
    #: window is only the safety net.
    window_max: int = 256
    #: Multiplicative decrease factor under pressure.
    dec_factor: float = 0.7
    #: Additive increase per control interval when healthy.
    inc: int = 1
    #: Target KV usage: the guard margin keeps ``1 - kv_target`` of all blocks free; also the high watermark.
    kv_target: float = 0.9
    #: KV usage at or below which the window may grow (and the KV pressure state clears);
    #: None: ``kv_target - 0.05``.
    kv_low: float | None = None
    #: Active roots per tool worker: the CPU cap on the window is ``ceil(workers x this)`` (the CPU
    #: plane's only rule).
    cpu_cap_per_worker: float = 1.5
    #: Prefill estimate above which a root is "long" (the footprint rule's draining); <= 0 disables it.
    long_prefill_tokens: int = 50_000
    #: Prompt tokens assumed for a root that arrives without any estimate.
    unknown_prefill_tokens: int = 2048
    #: Block size assumed until telemetry reports one.
    default_block_size: int = 16
    #: EMA weight of one observation of a root's per-turn growth, active time and LLM calls.
    growth_alpha: float = 0.2
    #: Upper bound on the learned per-turn growth (tokens) added to footprints.
    turn_growth_max_tokens: int = 32_768
    #: Seconds after admission until telemetry is trusted to include a root's first prefill; until
    #: then its footprint counts as promised and is subtracted from the budget.
    promise_s: float = 1.0
    #: Admission rule: "cost" (fits, or its rebuild cost is below its queueing cost; needs a cost
    #: model) or "footprint" (fits the budget only; the ``mars-no-cost-admission`` ablation).
    admit: str = "cost"
    #: Share of engine time spent recomputing (measured) at which the window shrinks ("cost" rule).
    rebuild_share_high: float = 0.25
    #: ... and at or below which it may grow again.
    rebuild_share_low: float = 0.1
    #: LLM calls assumed per root that reports none (until learned from finished roots).
    default_turns: int = 4
    #: A cost model file (``CostModel`` JSON or a step-time profile) for the "cost" rule; the driver
    #: hands its calibrated model instead (``set_cost_model``).
    cost_model: str | None = None
    #: Root sizing: "life" (the active roots' projected contexts over their remaining turns, plus
    #: the candidate's whole life, must stay within ``life_target`` of the pool at every future turn)
    #: or "turn" (the prefix plus one turn of growth against the free blocks only; the
    #: ``mars-no-life-admission`` ablation).
    size: str = "life"
    #: "life" sizing: the share of the pool the projected peak may reach. Above ``kv_target``: the
    #: guard margin is for the blocks allocated now, and a projected peak is reached (if at all)
    #: only at the end of the roots' lives, when a retained context can still make room.
    life_target: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = self._bad
        if not 0.1 <= self.dec_factor <= 0.99:
            raise bad("dec_factor", "in [0.1, 0.99]")
        if self.inc < 0:
            raise bad("inc", ">= 0")
        if not 0.1 <= self.kv_target <= 0.999:
            raise bad("kv_target", "in [0.1, 0.999]")
        if self.kv_low is None:
            object.__setattr__(self, "kv_low", max(0.0, round(self.kv_target - 0.05, 6)))
        if not 0 <= self.kv_low < self.kv_target:
            raise bad("kv_low", f"in [0, kv_target={self.kv_target})")
        if not self.cpu_cap_per_worker > 0:
            raise bad("cpu_cap_per_worker", "> 0")
        if self.unknown_prefill_tokens < 0:
            raise bad("unknown_prefill_tokens", ">= 0")
        if self.default_block_size < 1:
            raise bad("default_block_size", ">= 1")
        if not 0 < self.growth_alpha <= 1:
            raise bad("growth_alpha", "in (0, 1]")
        if self.turn_growth_max_tokens < 0:
            raise bad("turn_growth_max_tokens", ">= 0")
        if self.promise_s < 0:
            raise bad("promise_s", ">= 0")
        if self.admit not in ("cost", "footprint"):
            raise bad("admit", "'cost' or 'footprint'")
        if not 0 <= self.rebuild_share_low <= self.rebuild_share_high:
            raise bad("rebuild_share_low", f"in [0, rebuild_share_high={self.rebuild_share_high}]")
        if self.default_turns < 1:
            raise bad("default_turns", ">= 1")
        if self.size not in ("life", "turn"):
            raise bad("size", "'life' or 'turn'")
        if not 0.1 <= self.life_target <= 2.0:
            raise bad("life_target", "in [0.1, 2.0]")
