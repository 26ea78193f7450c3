"""Scheduling policies: pure decision logic, no vllm or torch import.

Importing this package registers every built-in policy; ``available_policies()`` lists them.
"""

from vllm_mars.policies.base import (  # noqa: I001  (the import order is the registration order)
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
from vllm_mars.policies import autellix as _autellix  # noqa: F401  (registers "autellix")
from vllm_mars.policies import continuum as _continuum  # noqa: F401  ("continuum", "continuum_dy")
from vllm_mars.policies import infercept as _infercept  # noqa: F401  ("infercept", "infercept_swap")
from vllm_mars.policies import lightllm as _lightllm  # noqa: F401  (registers "lightllm")
from vllm_mars.policies import mars as _mars  # noqa: F401  (registers "mars" and its ablations)

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
