"""MarsScheduler(fcfs) in the scheduler rig: same decisions as stock vLLM, chunking, preemption,
aborts, config errors, the injectable clock, and the retention mechanism. Each ends leak-free."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from vllm_mars.clock import VirtualClock
from vllm_mars.engine.rig import (
    assert_block_invariants,
    assert_no_leaks,
    fake_model_output,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)
from vllm_mars.engine.scheduler import MarsScheduler
from vllm_mars.policies import base as policy_base
from vllm_mars.policies.base import Policy


def _trace(seed: int, n: int = 200):
    """A seeded random arrival trace: (step, request kwargs), some with shared prefixes, and aborts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 4000) for _ in range(rng.choice((32, 64, 96)))] for _ in range(5)]
    arrivals, step_no = [], 0
    for i in range(n):
        step_no += rng.choice((0, 0, 1, 1, 2, 5))
        ids = list(rng.choice(prefixes)) if rng.random() < 0.5 else []
        ids += [rng.randrange(3, 4000) for _ in range(rng.randint(8, 300))]
        arrivals.append((step_no, {"request_id": f"r{i:03d}", "prompt_token_ids": ids,
                                       "max_tokens": rng.randint(1, 40), "priority": rng.randint(0, 3)}))
    aborts = {step_no: f"r{rng.randrange(n):03d}" for step_no in rng.sample(range(1, 400), 25)}
    return arrivals, aborts


def _snapshot(so):
    return (dict(so.num_scheduled_tokens), sorted(so.preempted_req_ids or ()),
            sorted(so.finished_req_ids), [r.req_id for r in so.scheduled_new_reqs])


def test_fcfs_matches_stock_vllm_step_by_step():
    kw = {"num_blocks": 160, "block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 512}
    ours = make_scheduler("fcfs", **kw)
    stock = make_scheduler(stock=True, **kw)
    assert type(ours) is MarsScheduler and type(stock) is Scheduler
    arrivals, aborts = _trace(seed=1234)
    pending = list(arrivals)
    steps = preemptions = 0
    while pending or ours.has_requests() or stock.has_requests():
        while pending and pending[0][0] <= steps:
            _, kwargs = pending.pop(0)
            ours.add_request(make_request(**kwargs))
            stock.add_request(make_request(**kwargs))
        if steps in aborts:
            ours.finish_requests(aborts[steps], RequestStatus.FINISHED_ABORTED)
            stock.finish_requests(aborts[steps], RequestStatus.FINISHED_ABORTED)
        so_a, so_b = ours.schedule(), stock.schedule()
        assert _snapshot(so_a) == _snapshot(so_b), f"decisions differ at step {steps}"
        preemptions += len(so_a.preempted_req_ids or ())
        out_a = ours.update_from_output(so_a, fake_model_output(ours, so_a, token=7 + steps % 50))
        out_b = stock.update_from_output(so_b, fake_model_output(stock, so_b, token=7 + steps % 50))
        fin = lambda out: sorted((o.request_id, o.finish_reason) for e in out.values() for o in e.outputs
                                 if o.finish_reason is not None)
        assert fin(out_a) == fin(out_b)
        assert_block_invariants(ours)
        steps += 1
        assert steps < 20_000
    assert preemptions > 0, "the trace must exercise preemption"
    assert ours.mars_num_preemptions == preemptions
    assert_no_leaks(ours)
    assert_no_leaks(stock)


def test_chunked_prefill_splits_long_prompts_by_the_token_budget():
    s = make_scheduler("fcfs", num_blocks=200, max_num_batched_tokens=128)
    s.add_request(make_request("a", prompt_len=300, max_tokens=2))
    s.add_request(make_request("b", prompt_len=300, max_tokens=2))
    per_step = []
    while s.has_requests():
        so, _ = step(s)
        per_step.append(dict(so.num_scheduled_tokens))
        assert so.total_num_scheduled_tokens <= 128
    assert sum(d.get("a", 0) for d in per_step) == 300 + 1  # prompt + one decode (the last token samples)
    assert per_step[0] == {"a": 128} and per_step[1] == {"a": 128}
    assert per_step[2] == {"a": 44, "b": 84}  # a finishes its prefill, b starts in the same step
    assert_no_leaks(s)


def test_preemption_in_a_tiny_pool_and_everyone_finishes_with_their_tokens():
    s = make_scheduler("fcfs", num_blocks=40, block_size=16)
    for i in range(8):
        s.add_request(make_request(f"p{i}", prompt_len=64, max_tokens=100))
    produced: dict[str, int] = {}
    preempted = 0
    while s.has_requests():
        so, outs = step(s)
        preempted += len(so.preempted_req_ids or ())
        for eco in outs.values():
            for o in eco.outputs:
                produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
        assert_block_invariants(s)
    assert preempted >= 1
    assert s.mars_stats()["preemptions"] == preempted and s.mars_stats()["recomputed_tokens"] > 0
    assert produced == {f"p{i}": 100 for i in range(8)}
    assert_no_leaks(s)


def test_abort_mid_prefill_frees_everything():
    s = make_scheduler("fcfs", num_blocks=100, max_num_batched_tokens=64)
    s.add_request(make_request("long", prompt_len=500, max_tokens=4))
    s.add_request(make_request("short", prompt_len=20, max_tokens=3))
    step(s)
    req = s.requests["long"]
    assert 0 < req.num_computed_tokens < 500, "must be mid-prefill"
    assert s.free_blocks() < s.num_blocks
    s.finish_requests("long", RequestStatus.FINISHED_ABORTED)
    run_to_completion(s)
    assert_no_leaks(s)


def test_unknown_policy_and_unknown_key_fail_at_start_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; available policies: .*fcfs"):
        make_scheduler("nope")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['colour'\].*valid keys: .*policy"):
        make_scheduler("fcfs", policy_options={"colour": "red"})


def test_policies_read_time_from_the_injected_clock():
    clock = VirtualClock(100.0)
    s = make_scheduler("fcfs", clock=clock)
    s.add_request(make_request("a", prompt_len=10, max_tokens=2, workflow="w", turn=3))
    clock.advance(2.5)
    s.add_request(make_request("b", prompt_len=10, max_tokens=2))
    a, b = s.call("a"), s.call("b")
    assert (a.arrival, b.arrival) == (100.0, 102.5)
    assert (a.workflow.workflow, a.workflow.turn, a.workflow.tagged) == ("w", 3, True)
    assert (b.workflow.workflow, b.workflow.last_step, b.workflow.tagged) == ("b", True, False)
    run_to_completion(s)
    assert_no_leaks(s)


def test_malformed_workflow_tags_do_not_take_the_engine_down():
    s = make_scheduler("fcfs")
    s.add_request(make_request("x", prompt_len=10, max_tokens=2, extra_args={"mars_turn": "many"}))
    assert s.call("x").workflow.tagged is False
    run_to_completion(s)
    assert_no_leaks(s)


# -- the retention mechanism, through a minimal test policy ------------------------------------
@dataclass(frozen=True)
class _RetainConfig:
    tau_s: float = 5.0


class _RetainAll(Policy):
    """Test policy: keep every finished non-last call's KV for tau_s; value = -arrival order."""

    name = "test-retain-all"
    Config = _RetainConfig
    retains = True

    def retention_s(self, call, num_blocks):
        return self.config.tau_s

    def retention_value(self, call, num_blocks):
        return float(call.seq)


@pytest.fixture
def retain_policy():
    policy_base._REGISTRY[_RetainAll.name] = _RetainAll
    try:
        yield _RetainAll.name
    finally:
        del policy_base._REGISTRY[_RetainAll.name]


def _turn(rid, wf, turn, ids, max_tokens=4, last=False):
    return make_request(rid, prompt_token_ids=ids, max_tokens=max_tokens, workflow=wf, turn=turn,
                        last_step=last, tool="bash")


def test_retention_keeps_blocks_until_return_and_the_next_turn_hits_them(retain_policy):
    clock = VirtualClock()
    s = make_scheduler(retain_policy, num_blocks=64, clock=clock)
    ids = list(range(10, 170))  # 160 tokens = 10 full blocks
    s.add_request(_turn("w-t0", "w", 0, ids))
    run_to_completion(s)
    assert len(s.retention) == 1 and s.retention.num_blocks == 10
    assert s.free_blocks() == s.num_blocks - 10, "retained blocks are not free"
    assert_block_invariants(s)
    clock.advance(1.0)
    s.add_request(_turn("w-t1", "w", 1, ids + [5] * 40, last=True))
    step(s)
    assert s.call("w-t1").num_cached_tokens == 160
    assert len(s.retention) == 0 and s.retention.stats.released_on_return == 1
    run_to_completion(s)
    assert_no_leaks(s)


def test_retention_expires_and_is_released_on_abort(retain_policy):
    clock = VirtualClock()
    s = make_scheduler(retain_policy, num_blocks=64, clock=clock, policy_options={"tau_s": 2.0})
    s.add_request(_turn("a-t0", "a", 0, list(range(10, 110))))
    s.add_request(_turn("b-t0", "b", 0, list(range(300, 400))))
    run_to_completion(s)
    assert len(s.retention) == 2
    clock.advance(2.5)
    s.add_request(_turn("b-t1", "b", 1, list(range(300, 420))))  # arrival after expiry: nothing held
    assert len(s.retention) == 0 and s.retention.stats.released_on_expiry == 2
    run_to_completion(s)  # b-t1 finishes (not last) -> retained again
    assert len(s.retention) == 1
    s.add_request(_turn("b-t2", "b", 2, list(range(300, 440))))
    s.finish_requests("b-t2", RequestStatus.FINISHED_ABORTED)
    assert len(s.retention) == 0 and s.retention.stats.released_on_abort == 1
    assert_no_leaks(s)


def test_retained_kv_is_reclaimed_before_anyone_is_preempted(retain_policy):
    clock = VirtualClock()
    s = make_scheduler(retain_policy, num_blocks=33, clock=clock, policy_options={"tau_s": 60.0})
    s.add_request(_turn("old-t0", "old", 0, list(range(10, 266))))  # 16 blocks
    run_to_completion(s)
    assert s.retention.num_blocks == 16
    s.add_request(make_request("big", prompt_len=400, max_tokens=40))  # needs 25+ blocks
    preempted = 0
    while s.has_requests():
        so, _ = step(s)
        preempted += len(so.preempted_req_ids or ())
        assert_block_invariants(s)
    assert preempted == 0
    assert s.retention.stats.released_under_pressure == 1 and len(s.retention) == 0
    assert_no_leaks(s)


def test_retained_block_seconds_count_on_the_clock_set_after_construction(retain_policy):
    # the sim and the tests set the scheduler's clock after it is built: a release under pressure
    # must read that clock, not the wall clock the reclaim wrapper saw at construction
    clock = VirtualClock()
    s = make_scheduler(retain_policy, num_blocks=33, clock=clock, policy_options={"tau_s": 60.0})
    s.add_request(_turn("old-t0", "old", 0, list(range(10, 266))))  # 16 blocks
    run_to_completion(s)
    assert s.retention.num_blocks == 16
    clock.advance(5.0)
    s.add_request(make_request("big", prompt_len=400, max_tokens=40))  # reclaims "old" at t = 5 s
    run_to_completion(s)
    assert s.retention.stats.released_under_pressure == 1
    assert s.retention.stats.block_seconds == pytest.approx(16 * 5.0)  # not 16 x tau (60 s)
    assert_no_leaks(s)


def test_retention_is_kept_when_releasing_it_could_not_make_a_waiting_call_fit(retain_policy):
    clock = VirtualClock()
    s = make_scheduler(retain_policy, num_blocks=41, clock=clock, policy_options={"tau_s": 60.0})
    s.add_request(_turn("keep-t0", "keep", 0, list(range(10, 138))))  # 128 tokens = 8 blocks
    run_to_completion(s)
    assert s.retention.num_blocks == 8
    s.add_request(make_request("runner", prompt_len=300, max_tokens=60))  # up to 23 blocks
    step(s)
    s.add_request(make_request("big", prompt_len=470, max_tokens=2))  # needs 30 blocks
    while "runner" in s.requests:
        step(s)
        assert_block_invariants(s)
        if "runner" in s.requests:
            assert s.free_blocks() + s.retention.num_blocks < 30, "scenario: big cannot fit yet"
            assert len(s.retention) == 1, "releasing retention could not have helped big"
    run_to_completion(s)
    assert s.retention.stats.released_under_pressure == 0
    clock.advance(61.0)
    s.add_request(make_request("tick", prompt_len=8, max_tokens=1))  # arrival expires retention
    run_to_completion(s)
    assert s.retention.stats.released_on_expiry == 1
    assert_no_leaks(s)
