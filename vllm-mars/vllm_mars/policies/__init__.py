"""Scheduling policies: pure decision logic, no vllm or torch import.

Importing this package registers every built-in policy; ``available_policies()`` lists them.
"""

from vllm_mars.policies.base import (
    CallView,
    EngineView,
    Policy,
    available_policies,
    config_fields,
    get_policy_class,
    make_policy,
    register_policy,
)
from vllm_mars.policies import fcfs as _fcfs  # noqa: F401  (registers "fcfs")

__all__ = [
    "CallView",
    "EngineView",
    "Policy",
    "available_policies",
    "config_fields",
    "get_policy_class",
    "make_policy",
    "register_policy",
]
