"""Seeded randomized invariant test over every registered policy (real vLLM scheduler, rig).

At least 2,000 short episodes in all, split evenly over ``available_policies()`` (collected at
import, so policies registered later are covered automatically). Each episode: a few multi-turn
workflows sharing prefixes across turns, untagged calls, tool gaps on a virtual clock (some
returns inside the retention window, some after it), random aborts, and a KV pool small enough
to force preemptions. After every step the block counts are conserved and no ref count is
negative; at the end of every episode every call has finished (or was aborted), and once the
clock passes any retention, nothing is left: no request, no block, no retained entry.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
from vllm.v1.request import RequestStatus
from vllm_mars.clock import VirtualClock
from vllm_mars.config import ENGINE_KEYS
from vllm_mars.engine.rig import assert_block_invariants, assert_no_leaks, make_request, make_scheduler, step
from vllm_mars.policies import available_policies, config_fields, get_policy_class

TOTAL_EPISODES = 2000
POLICIES = available_policies()


def _cpu_refusal(policy: str) -> str | None:
    try:
        get_policy_class(policy)().check_platform("cpu")
    except ValueError as e:
        return str(e)
    return None


# Split over the policies that can run here, so at least TOTAL_EPISODES run in all.
EPISODES_PER_POLICY = math.ceil(TOTAL_EPISODES / max(sum(_cpu_refusal(p) is None for p in POLICIES), 1))
STEP_S = 0.05  # virtual seconds per engine step

# Make retention likely where a policy has these knobs (small contexts are otherwise not worth it).
_RETENTION_FRIENDLY = {"cost_model": {"prefill_s_per_token": 2e-3, "source": "test"}, "cold_start_tau_s": 1.0,
                       "max_retention_s": 3.0}


@dataclass
class _Workflow:
    name: str
    turns: int
    ids: list[int]
    turn: int = 0
    next_arrival: float = 0.0
    live: str | None = None  # request id in flight
    done: bool = False
    tagged: bool = True


@dataclass
class _Stats:
    steps: int = 0
    preemptions: int = 0
    aborts: int = 0
    retained: int = 0
    calls: int = 0
    finished: set = field(default_factory=set)


def _episode(s, clock: VirtualClock, rng: random.Random, ep: int, st: _Stats) -> None:
    wfs = []
    for w in range(rng.randint(2, 4)):
        shared = list(range(3, 3 + rng.choice((0, 16, 48))))  # a common system prefix
        ids = shared + [rng.randrange(100, 4000) for _ in range(rng.randint(8, 200))]
        wfs.append(_Workflow(f"e{ep}w{w}", rng.randint(1, 4), ids,
                             next_arrival=clock.now() + rng.random() * 0.3, tagged=rng.random() < 0.85))
    added: set[str] = set()
    aborted: set[str] = set()
    by_id = {}
    while True:
        now = clock.now()
        for wf in wfs:
            if not wf.done and wf.live is None and wf.next_arrival <= now:
                rid = f"{wf.name}t{wf.turn}"
                last = wf.turn == wf.turns - 1
                kw = {"workflow": wf.name, "turn": wf.turn, "last_step": last,
                      "tool": rng.choice(("bash", "read", None))} if wf.tagged else {}
                s.add_request(make_request(rid, prompt_token_ids=wf.ids, max_tokens=rng.randint(1, 32), **kw))
                wf.live = rid
                by_id[rid] = wf
                added.add(rid)
                st.calls += 1
        live = [wf.live for wf in wfs if wf.live is not None]
        if live and rng.random() < 0.02:
            rid = rng.choice(live)
            s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
            st.aborts += 1
            wf = by_id[rid]
            wf.live, wf.done = None, True
        if not s.has_requests() and all(wf.done or wf.live is None for wf in wfs):
            if all(wf.done for wf in wfs):
                break
            clock.set(max(clock.now(), min(wf.next_arrival for wf in wfs if not wf.done)))
            continue
        so, outputs = step(s, token=rng.randrange(100, 4000))
        st.steps += 1
        st.preemptions += len(so.preempted_req_ids or ())
        assert_block_invariants(s)
        for eco in outputs.values():
            for o in eco.outputs:
                wf = by_id[o.request_id]
                wf.ids = wf.ids + list(o.new_token_ids)
                if o.finish_reason is not None:
                    st.finished.add(o.request_id)
                    wf.live = None
                    wf.turn += 1
                    if wf.turn >= wf.turns:
                        wf.done = True
                    else:  # the tool call: the next turn appends tool output after a gap
                        wf.ids = wf.ids + [rng.randrange(100, 4000) for _ in range(rng.randint(1, 64))]
                        wf.next_arrival = clock.now() + rng.choice((0.0, 0.2, 0.5, 1.0, 2.5, 4.0))
        st.retained = max(st.retained, len(s.retention))
        clock.advance(STEP_S)
        assert st.steps < 10_000_000
    assert added == (st.finished & added) | aborted, f"unfinished: {sorted(added - st.finished - aborted)}"
    clock.advance(1000.0)
    s.schedule()  # releases expired retention
    assert_no_leaks(s)


@pytest.mark.parametrize("policy", POLICIES)
def test_random_episodes_conserve_blocks_and_leak_nothing(policy: str):
    cls = get_policy_class(policy)
    refusal = _cpu_refusal(policy)
    if refusal is not None:
        pytest.skip(f"{policy} does not run on CPU: {refusal}")
    options = {k: v for k, v in _RETENTION_FRIENDLY.items() if k in config_fields(cls) or k in ENGINE_KEYS}
    clock = VirtualClock()
    s = make_scheduler(policy, num_blocks=40, block_size=16, max_num_batched_tokens=256, max_num_seqs=8,
                       max_model_len=2048, policy_options=options, clock=clock)
    rng = random.Random(f"invariants-{policy}")
    st = _Stats()
    for ep in range(EPISODES_PER_POLICY):
        _episode(s, clock, rng, ep, st)
    # The workload must exercise what it claims to.
    assert st.aborts > 0 and st.calls >= 3 * EPISODES_PER_POLICY, vars(st)
    if not s.mars_policy.gates:  # a gate (lightllm) may avoid preemption by design
        assert st.preemptions > 0, vars(st)
    if getattr(s.mars_policy, "retains", False):
        assert s.retention.stats.retained > 0, vars(s.retention.stats)
    if policy.startswith("mars") and s.mars_policy.retains:
        rs = s.retention.stats
        assert rs.released_on_return > 0 and rs.released_on_expiry > 0, vars(rs)
