"""Which running call vLLM preempts under an ordering policy (the victim rank the scheduler writes
into ``Request.priority``, vLLM's PRIORITY mode preempting the largest).

* With vLLM's ``--scheduling-policy priority`` the request's own vLLM priority is the user's order:
  it ranks the victims first (as stock vLLM ranks them), the policy's order breaking ties, also
  when the priority is set after arrival (vLLM's own ``tests/v1/core`` does that).
* A failed allocation the scheduler's seam does not see (another wrapper of ``allocate_slots``
  outside ours, as vLLM's tests install) preempts by the step's running order, never by a rank
  left over from an earlier step or by a priority vLLM's fcfs mode ignores.

Real vLLM scheduler (the rig), fake model output, virtual clock; each case ends leak-free.
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
from vllm_mars.clock import VirtualClock
from vllm_mars.engine.rig import assert_block_invariants, assert_no_leaks, make_request, make_scheduler, step

ORDERING = ("continuum", "continuum_dy", "infercept", "autellix", "mars")


def _add(s, rid: str, max_tokens: int, priority: int = 0):
    req = make_request(rid, prompt_len=48, max_tokens=max_tokens, priority=priority)
    s.add_request(req)
    return req


def _drain(s) -> None:
    while s.has_requests():
        step(s)
        assert_block_invariants(s)
    assert_no_leaks(s)


def _first_victims(policy: str | None, scheduling_policy: str) -> list[str]:
    """Three calls that outgrow a 24-block pool; the first step that preempts: its victims.
    ``a`` arrives first with priority 0 and is given priority 5 after the first step, ``c`` has 1."""
    kw = {"num_blocks": 25, "block_size": 16, "scheduling_policy": scheduling_policy, "clock": VirtualClock()}
    s = make_scheduler(policy, **kw) if policy else make_scheduler(stock=True, **kw)
    reqs = {"a": _add(s, "a", 200), "b": _add(s, "b", 200), "c": _add(s, "c", 200, priority=1)}
    step(s)
    reqs["a"].priority = 5
    victims: list[str] = []
    for _ in range(1000):
        so, _ = step(s)
        assert_block_invariants(s)
        if so.preempted_req_ids:
            victims = sorted(so.preempted_req_ids)
            break
    _drain(s)
    return victims


@pytest.mark.parametrize("policy", ORDERING)
def test_user_priority_ranks_victims_first_in_priority_mode(policy):
    stock = _first_victims(None, "priority")
    assert stock == ["a"], stock  # stock vLLM preempts the worst priority
    assert _first_victims(policy, "priority") == stock
    # In vLLM's fcfs mode the priority decides nothing: the policy's own victim (the latest call).
    assert _first_victims(policy, "fcfs") == ["c"]


def _outer_failure(policy: str | None) -> tuple[list[str], int, list[str]]:
    """Three decoding calls; a wrapper outside the scheduler's seam fails the first allocation of
    one step. Returns (that step's victims, allocations tried, calls scheduled)."""
    kw = {"num_blocks": 200, "block_size": 16, "clock": VirtualClock()}
    s = make_scheduler(policy, **kw) if policy else make_scheduler(stock=True, **kw)
    _add(s, "a", 30, priority=9)  # vLLM's fcfs mode ignores the priority
    _add(s, "b", 30)
    _add(s, "c", 30, priority=1)
    step(s)
    step(s)
    inner = s.kv_cache_manager.allocate_slots
    tries = 0

    def allocate(*args, **kwargs):
        nonlocal tries
        tries += 1
        return None if tries == 1 else inner(*args, **kwargs)

    with patch.object(s.kv_cache_manager, "allocate_slots", side_effect=allocate):
        so, _ = step(s)
    victims, scheduled = sorted(so.preempted_req_ids or ()), sorted(so.num_scheduled_tokens)
    _drain(s)
    return victims, tries, scheduled


@pytest.mark.parametrize("policy", ("fcfs", "autellix", "mars", "continuum"))
def test_a_failure_outside_the_seam_preempts_by_the_running_order(policy):
    stock = _outer_failure(None)
    assert stock == (["c"], 3, ["a", "b"]), stock  # the newest call yields, a's allocation is retried
    assert _outer_failure(policy) == stock
