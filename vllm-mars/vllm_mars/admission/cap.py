"""The admission yardstick: a static cap on concurrent root workflows.

At most ``cap`` roots are active at once; the rest wait in arrival order (a returning root first,
as in every controller). No telemetry, no footprint, no window that moves: the simplest admission
there is. Swept per cell (``experiments/paper/yardstick.toml``), its best value in hindsight is the
yardstick mars's adaptive admission is read against: how much of mars's win a well-tuned static cap
already gets. Driver policies: ``fcfs-cap`` (fcfs behind the cap) and ``mars-cap`` (mars's scheduler
behind the cap); ``--admission-option cap=N`` / a variant's ``admission_options`` set N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_mars.admission.base import ControllerBase, config_from_dict, register_controller


@dataclass(frozen=True)
class CapConfig:
    """Knobs of the static cap."""

    #: Most root workflows active at once.
    cap: int = 8
    #: How often the feeder ticks (s); a finish frees a slot at the next tick.
    interval_s: float = 0.2

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"CapConfig.cap = {self.cap!r}: must be >= 1")
        if not self.interval_s >= 0.01:
            raise ValueError(f"CapConfig.interval_s = {self.interval_s!r}: must be >= 0.01")

    @classmethod
    def from_dict(cls, d: Any) -> CapConfig:
        return config_from_dict(cls, d)


@register_controller
class CapController(ControllerBase):
    """Admit in arrival order while fewer than ``cap`` roots are active."""

    name = "cap"
    config_cls = CapConfig
    config: CapConfig

    def __init__(self, config: CapConfig | None = None) -> None:
        super().__init__(config)
        self.window = self.config.cap

    def tick(self, now: float) -> list[str]:
        out: list[str] = []
        while self._queue and len(self._active) < self.config.cap:
            wf, root = next(iter(self._queue.items()))
            self._admit(root, now)
            out.append(wf)
            self._emit(now, "admission_admit", {"workflow": wf, "mode": "cap", "limit": self.config.cap,
                                                "active": len(self._active), "queued": len(self._queue),
                                                "waited_s": round(now - root.arrival, 6)})
        return out
