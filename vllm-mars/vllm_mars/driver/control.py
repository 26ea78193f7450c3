"""What a driver policy name means: the engine's scheduling policy and the admission controller.

``mars`` = MARS admission + the ``mars`` scheduler policy; ``concur`` = CONCUR admission + ``fcfs``;
``mars-no-admission`` = the ``mars`` scheduler policy with every root admitted at once (the
ablation); any other name = that scheduler policy with no admission control.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_mars.admission.base import AdmissionController
from vllm_mars.admission.base import make_controller as _make_controller

_SPECIAL = {
    "mars": ("mars", "mars"),
    "concur": ("fcfs", "concur"),
    "mars-no-admission": ("mars", "none"),
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
    from vllm_mars.policies import available_policies

    sched = list(available_policies())
    names = list(sched)
    for special, (s, _) in _SPECIAL.items():
        if s in sched and special not in names:
            names.append(special)
    return names


def check_policy(name: str) -> DriverPolicy:
    """Resolve ``name``; a scheduler policy that is not registered raises ValueError listing the known ones."""
    from vllm_mars.policies import available_policies

    p = resolve_policy(name)
    if p.scheduler_policy not in available_policies():
        raise ValueError(f"policy {name!r} needs scheduler policy {p.scheduler_policy!r}, which is not registered; "
                         f"available: {', '.join(driver_policy_names())}")
    return p


def make_controller(name: str, options: Mapping[str, Any] | None = None) -> AdmissionController:
    """A registered admission controller (see :func:`vllm_mars.admission.base.make_controller`)."""
    return _make_controller(name, options)


def finish_root(ctrl: AdmissionController, workflow: str, now: float, final_tokens: int | None) -> None:
    """``ctrl.finish``, passing the workflow's final context size where the controller takes it."""
    try:
        params = inspect.signature(ctrl.finish).parameters
    except (TypeError, ValueError):
        params = {}
    if "final_tokens" in params:
        ctrl.finish(workflow, now, final_tokens=final_tokens)
    else:
        ctrl.finish(workflow, now)


def update_root_progress(ctrl: AdmissionController, workflow: str, prompt_tokens: int, now: float) -> None:
    """A root's next turn starts with ``prompt_tokens`` of context: the controller learns its
    growth (as the sidecar reports each larger agent prompt), where it takes estimates."""
    update = getattr(ctrl, "update_estimate", None)
    if update is not None:
        update(workflow, prompt_tokens, now)


def report_root_cached(ctrl: AdmissionController, workflow: str, cached_tokens: int | None) -> None:
    """Root ``workflow``'s first call found ``cached_tokens`` of its prompt cached (KV shared with
    other workflows), where the controller takes it."""
    observe = getattr(ctrl, "observe_cached", None)
    if observe is not None and cached_tokens is not None:
        observe(workflow, cached_tokens)
