"""What a driver policy name means: the engine's scheduling policy and the admission controller.

``mars`` = MARS admission + the ``mars`` scheduler policy; ``concur`` = CONCUR admission + ``fcfs``;
``mars-no-admission`` = the ``mars`` scheduler policy with every root admitted at once (the
ablation); any other name = that scheduler policy with no admission control.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_mars.policies import available_policies

_SPECIAL = {
    "mars": ("mars", "mars"),
    "concur": ("fcfs", "concur"),
    # CONCUR's admission in front of Continuum's scheduler (the seed's continuum_dy_con is the second)
    "continuum-concur": ("continuum", "concur"),
    "continuum_dy-concur": ("continuum_dy", "concur"),
    "mars-no-admission": ("mars", "none"),
    # the admission yardstick (admission/cap.py): a static cap on concurrent roots, swept per cell
    "fcfs-cap": ("fcfs", "cap"),
    "mars-cap": ("mars", "cap"),
    "mars-no-cost-admission": ("mars", "mars"),
    "mars-no-life-admission": ("mars", "mars"),
}
#: Admission options an ablation sets (the user's --admission-option still wins).
_CONTROLLER_OPTIONS: dict[str, dict[str, Any]] = {
    "mars-no-cost-admission": {"admit": "footprint"},
    "mars-no-life-admission": {"size": "turn"},
}


@dataclass(frozen=True)
class DriverPolicy:
    name: str
    scheduler_policy: str
    controller: str
    #: controller options this driver policy implies (an ablation's switch)
    controller_options: Mapping[str, Any] = field(default_factory=dict)


def resolve_policy(name: str) -> DriverPolicy:
    sched, ctrl = _SPECIAL.get(name, (name, "none"))
    return DriverPolicy(name, sched, ctrl, dict(_CONTROLLER_OPTIONS.get(name, {})))


def driver_policy_names() -> list[str]:
    """Every name ``mars replay --policy`` accepts: the registered scheduler policies plus the
    admission variants (those whose scheduler policy is registered)."""
    sched = list(available_policies())
    names = list(sched)
    for special, (s, _) in _SPECIAL.items():
        if s in sched and special not in names:
            names.append(special)
    return names


def check_policy(name: str) -> DriverPolicy:
    """Resolve ``name``; a scheduler policy that is not registered raises ValueError listing the known ones."""
    p = resolve_policy(name)
    if p.scheduler_policy not in available_policies():
        raise ValueError(f"policy {name!r} needs scheduler policy {p.scheduler_policy!r}, which is not registered; "
                         f"available: {', '.join(driver_policy_names())}")
    return p
