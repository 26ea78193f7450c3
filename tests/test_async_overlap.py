"""AsyncMarsScheduler driven the way vLLM's engine core drives it under async scheduling.

``RigEngineCore`` runs vLLM's own ``EngineCore.step_with_batch_queue`` over the rig scheduler: the
schedule of step N+1 happens before the output of step N is processed (depth 1, what async
scheduling runs) or before N and N-1 are (depth 2). Multi-turn workflows with shared prefixes,
a KV pool small enough to preempt, aborts landing while a step is in flight (through the engine's
abort queue and between steps), and stop-token finishes with later steps already launched. Every
registered policy that runs on this platform; block invariants after every engine iteration, the
leak check at the end, and ``recomputed_tokens`` counting only tokens whose KV had been computed.
"""

from __future__ import annotations

import random

import pytest
from vllm_mars.clock import VirtualClock
from vllm_mars.engine.rig import (
    RigEngineCore,
    assert_block_invariants,
    assert_no_leaks,
    fake_model_output,
    make_request,
    make_scheduler,
)
from vllm_mars.engine.scheduler import AsyncMarsScheduler
from vllm_mars.policies import available_policies, get_policy_class

STOP = 7
STEP_S = 0.02


def _runs_here(policy: str) -> bool:
    try:
        get_policy_class(policy)().check_platform("cpu")
    except ValueError:
        return False
    return True


POLICIES = [p for p in available_policies() if _runs_here(p)]


def _stopping_output(rng: random.Random, stoppable: set[str]):
    """The rig's fake model, emitting the stop token now and then for ``stoppable`` requests."""

    def fn(s, so):
        out = fake_model_output(s, so)
        for i, rid in enumerate(out.req_ids):
            if out.sampled_token_ids[i] and rid in stoppable and rng.random() < 0.15:
                out.sampled_token_ids[i] = [STOP]
        return out

    return fn


def _episode(policy: str, depth: int, seed: int, num_blocks: int = 30, max_out: int = 100) -> dict[str, int]:
    rng = random.Random(seed)
    clock = VirtualClock()
    s = make_scheduler(policy, num_blocks=num_blocks, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                       scheduler_cls=AsyncMarsScheduler, clock=clock)
    assert isinstance(s, AsyncMarsScheduler)
    stoppable: set[str] = set()
    core = RigEngineCore(s, depth=depth, output_fn=_stopping_output(rng, stoppable))
    # workflow -> [prompt ids, turns left, turn, due time or None while a call is live]
    wfs = {f"w{i}": [[3 + (j % 40) for j in range(48)] + [rng.randrange(100, 4000) for _ in range(rng.randint(8, 120))],
                     rng.randint(1, 3), 0, rng.random() * 0.1] for i in range(6)}
    live: dict[str, str] = {}  # request id -> workflow
    counts = {"steps": 0, "aborts_in_flight": 0, "stops_in_flight": 0, "preempt_in_flight": 0, "max_depth": 0}
    expected_recomputed = 0
    while True:
        now = clock.now()
        for wid, wf in wfs.items():
            ids, left, turn, due = wf
            if due is not None and due <= now and left > 0:
                rid = f"{wid}t{turn}"
                if rng.random() < 0.5:
                    stoppable.add(rid)
                s.add_request(make_request(rid, prompt_token_ids=ids, max_tokens=rng.randint(4, max_out),
                                           workflow=wid, turn=turn, last_step=left == 1,
                                           stop_token_ids=[STOP]))
                live[rid] = wid
                wf[3] = None
        if not core.busy():
            if all(wf[1] == 0 for wf in wfs.values()):
                break
            clock.advance(STEP_S)
            continue
        # Aborts while a step is in flight: through the engine's queue (processed just before the
        # next output) or between iterations (as the engine's input queue does).
        if live and core.batch_queue and rng.random() < 0.04:
            rid = rng.choice(sorted(live))
            if rng.random() < 0.5:
                core.aborts_queue.put([rid])
            else:
                s.finish_requests([rid], _aborted())
            counts["aborts_in_flight"] += 1
        in_flight = core.in_flight_tokens()
        counts["max_depth"] = max(counts["max_depth"], len(core.batch_queue))  # launched, not yet processed
        computed = {rid: r.num_computed_tokens for rid, r in s.requests.items()}
        preempted_before, recomputed_before = s.mars_num_preemptions, s.mars_recomputed_tokens
        outs = core.run_step()
        counts["steps"] += 1
        assert_block_invariants(s)
        if s.mars_num_preemptions > preempted_before:
            # Preemptions happen inside schedule(): the step just launched (the queue's newest entry)
            # names them; their KV had been computed up to num_computed minus what was in flight.
            so = core.batch_queue[0][1]
            want = 0
            for rid in so.preempted_req_ids:
                want += max(0, computed[rid] - in_flight.get(rid, 0))
                counts["preempt_in_flight"] += in_flight.get(rid, 0) > 0
            assert s.mars_recomputed_tokens - recomputed_before == want
            expected_recomputed += want
        for o in outs:
            if o.finish_reason is None:
                continue
            if o.stop_reason == STOP and core.in_flight_tokens().get(o.request_id):
                counts["stops_in_flight"] += 1
        for rid in [r for r in live if r not in s.requests]:
            wid = live.pop(rid)
            wf = wfs[wid]
            req_out = [42] * 4
            wf[0] = wf[0] + req_out + [rng.randrange(100, 4000) for _ in range(rng.randint(4, 40))]
            wf[1] -= 1
            wf[2] += 1
            wf[3] = clock.now() + rng.choice((0.0, STEP_S, 0.3, 1.0))
        clock.advance(STEP_S)
        assert counts["steps"] < 20_000, "episode did not finish"
    assert s.mars_recomputed_tokens == expected_recomputed
    s.release_retention()
    assert_no_leaks(s)
    counts["preemptions"] = s.mars_num_preemptions
    return counts


def _aborted():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_async_overlap_every_policy(policy, depth):
    totals = {"steps": 0, "aborts_in_flight": 0, "stops_in_flight": 0, "preempt_in_flight": 0, "preemptions": 0,
              "max_depth": 0}
    for seed in range(3):
        for k, v in _episode(policy, depth, seed * 7 + depth).items():
            totals[k] = max(totals[k], v) if k == "max_depth" else totals[k] + v
    assert totals["max_depth"] == depth, totals  # schedule() ran with `depth` steps in flight
    # The episodes must really have exercised the overlap paths.
    assert totals["aborts_in_flight"] > 0, totals
    assert totals["stops_in_flight"] > 0, totals


def test_overlap_covers_preemption_with_tokens_in_flight():
    """Under depth 1 with a tight pool, preemptions hit requests with a step in flight, and their
    in-flight tokens are not counted as recomputed (the per-step check inside the episode)."""
    seen = 0
    for seed in range(6):
        seen += _episode("fcfs", 1, 100 + seed)["preempt_in_flight"]
    assert seen > 0


def test_infercept_swap_is_the_only_policy_left_out():
    assert set(available_policies()) - set(POLICIES) <= {"infercept_swap"}
