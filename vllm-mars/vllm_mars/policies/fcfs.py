"""``fcfs``: vLLM's own behaviour, unchanged (arrival order; the newest running call is the victim)."""

from __future__ import annotations

from vllm_mars.policies.base import Policy, register_policy


@register_policy
class FcfsPolicy(Policy):
    """Stock vLLM scheduling. Uses no seam, so MarsScheduler(fcfs) adds no per-step work."""

    name = "fcfs"
