"""The baseline policies in the scheduler rig: one crafted scenario per policy where its defining
decision differs from fcfs. Real vLLM Scheduler, fake model output, virtual clock; each scenario
ends leak-free."""

from __future__ import annotations

import pytest
from vllm_mars.clock import VirtualClock
from vllm_mars.engine.rig import assert_block_invariants, assert_no_leaks, make_request, make_scheduler, step
from vllm_mars.policies import make_policy
from vllm_mars.policies.continuum import _Eta, best_tau
from vllm_mars.policies.infercept import InferceptSwapPolicy
from vllm_mars.policies.lightllm import peak_demand

OUT = 42  # the token the rig's fake model samples


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + j * 31) % 4000 + 3 for j in range(n)]


def add(s, rid: str, prompt: list[int], max_tokens: int, wf: str | None = None, turn: int = 0,
        last: bool = False, tool: str | None = None):
    req = make_request(rid, prompt_token_ids=prompt, max_tokens=max_tokens, workflow=wf, turn=turn,
                       last_step=last if wf is not None else None, tool=tool)
    s.add_request(req)
    return req


def finish(s, rid: str, max_steps: int = 10_000) -> None:
    """Step until ``rid`` has finished."""
    for _ in range(max_steps):
        if rid not in s.requests:
            return
        step(s)
        assert_block_invariants(s)
    raise AssertionError(f"{rid} not finished")


def drain(s, clock: VirtualClock | None = None) -> None:
    """Run everything to completion, let retention expire, and check for leaks."""
    while s.has_requests():
        step(s)
        assert_block_invariants(s)
    if clock is not None:
        clock.advance(10_000.0)
        step(s)  # releases expired retention
    assert_no_leaks(s)


def first_scheduled(s) -> dict[str, int]:
    so, _ = step(s)
    return dict(so.num_scheduled_tokens)


# -- autellix -------------------------------------------------------------------------------------
def _autellix_rig(policy: str):
    clock = VirtualClock()
    s = make_scheduler(policy, num_blocks=400, block_size=16, max_num_batched_tokens=256, clock=clock)
    # Program A's first call: 3000 prompt tokens = 0.6 s of model time at 0.0002 s/token.
    add(s, "a0", ids(1, 3000), 2, wf="A", turn=0)
    finish(s, "a0")
    clock.advance(1.0)  # A's tool call
    add(s, "a1", ids(1, 3000) + [OUT] * 2 + ids(2, 400), 2, wf="A", turn=1, last=True)
    add(s, "b0", ids(3, 512), 2, wf="B", turn=0, last=True)  # a new program, arriving later
    return s, clock


def test_autellix_serves_the_program_with_less_attained_service_first():
    s, clock = _autellix_rig("autellix")
    pol = s.mars_policy
    # 12 steps of 256 tokens (one of 184) + 1 decode: exactly the per-step cost model.
    assert pol.program_service("A") == pytest.approx(13 * 0.015 + 3001 * 0.0002)
    assert pol.program_service("A") > pol.config.service_thresholds_s[0]
    got = first_scheduled(s)
    assert got.get("b0") == 256 and "a1" not in got, got  # b0 (queue 0) before a1 (queue 1)
    drain(s, clock)

    fcfs, clock = _autellix_rig("fcfs")
    got = first_scheduled(fcfs)
    assert "a1" in got and "b0" not in got, got  # fcfs: arrival order
    drain(fcfs, clock)


@pytest.mark.parametrize("fraction, a_first", [(0.0, False), (0.99, False), (1.01, True)])
def test_autellix_promotes_a_starved_call_at_beta(fraction, a_first):
    s, clock = _autellix_rig("autellix")
    pol = s.mars_policy
    # a1 sits in queue 1 with T_c = 0 and W_p = 0 (a0 never waited): promoted to queue 0 once
    # W_c / T_p >= beta. Then FCFS within queue 0 puts a1 (earlier) before b0.
    boundary = pol.config.beta * pol.program_service("A")
    clock.advance(fraction * boundary)
    got = first_scheduled(s)
    if a_first:
        assert "a1" in got and "b0" not in got, got
    else:
        assert "b0" in got and "a1" not in got, got
    drain(s, clock)


def _victim_rig(policy: str):
    clock = VirtualClock()
    # 60 usable blocks; a small step cost so the two contenders stay in their entry queues.
    opts = {"step_s": 0.001, "service_thresholds_s": [0.05, 1.0, 2.0]} if policy == "autellix" else None
    s = make_scheduler(policy, num_blocks=61, block_size=16, clock=clock, policy_options=opts)
    add(s, "a0", ids(1, 300), 1, wf="A", turn=0)  # 0.061 s of service: program A -> queue 1
    finish(s, "a0")
    add(s, "a1", ids(4, 440), 100, wf="A", turn=1, last=True)  # queue 1
    add(s, "b0", ids(5, 440), 100, wf="B", turn=0, last=True)  # queue 0, arrived later
    preempted = []
    while s.has_requests():
        so, _ = step(s)
        preempted += list(so.preempted_req_ids or ())
        assert_block_invariants(s)
    drain(s, clock)
    return preempted


def test_autellix_victim_is_the_lowest_queue():
    preempted = _victim_rig("autellix")
    assert preempted and preempted[0] == "a1", preempted
    preempted = _victim_rig("fcfs")
    assert preempted and preempted[0] == "b0", preempted  # fcfs pops the newest running call


# -- infercept ------------------------------------------------------------------------------------
def _run_workflow(s, clock, wf: str, turns: int, gap: float, seed: int, prompt_len: int = 600,
                  tool: str = "t", out: int = 2):
    """A workflow whose calls return after ``gap`` seconds; returns the retention seen after each call."""
    prompt = ids(seed, prompt_len)
    retained = []
    for k in range(turns):
        last = k == turns - 1
        add(s, f"{wf}-{k}", prompt, out, wf=wf, turn=k, last=last, tool=tool if k else None)
        finish(s, f"{wf}-{k}")
        entry = s.retention.get(wf)
        retained.append(entry.expires - clock.now() if entry is not None else 0.0)
        prompt = prompt + [OUT] * out + ids(seed + 100 + k, 20)
        clock.advance(gap)
    return retained


@pytest.mark.parametrize("gap, preserve", [(0.05, True), (0.5, False)])
def test_infercept_preserves_short_tool_calls_and_discards_long_ones(gap, preserve):
    clock = VirtualClock()
    s = make_scheduler("infercept", num_blocks=400, block_size=16, clock=clock)
    held = _run_workflow(s, clock, "W", turns=6, gap=gap, seed=7)
    # break-even: T_fwd(C) * (C + 0) / C = 0.0002 s/token * C, C ~ 600-700 tokens -> ~0.13 s
    d = s.mars_policy.last_decision
    assert d.context >= 600 and d.other == 0
    assert held[0] == pytest.approx(0.0002 * 602)  # no history yet: preserve until break-even
    # after min_samples (3) observed gaps the learned mean decides
    assert all(h > 0 for h in held[:3]), held
    assert [h > 0 for h in held[3:5]] == [preserve, preserve], held
    assert d.action == ("preserve" if preserve else "discard")
    drain(s, clock)


def test_infercept_retention_is_reused_on_return_and_expires_at_break_even():
    clock = VirtualClock()
    s = make_scheduler("infercept", num_blocks=400, block_size=16, clock=clock)
    prompt = ids(9, 640)
    add(s, "w0", prompt, 2, wf="W", turn=0)
    finish(s, "w0")
    entry = s.retention.get("W")
    assert entry is not None and entry.expires == pytest.approx(0.0002 * 642)
    clock.advance(0.05)
    r1 = add(s, "w1", prompt + [OUT] * 2 + ids(10, 30), 2, wf="W", turn=1)
    so, _ = step(s)
    assert so.num_scheduled_tokens["w1"] == r1.num_prompt_tokens - 640  # 40 retained blocks hit
    assert "W" not in s.retention and s.retention.stats.released_on_return == 1
    finish(s, "w1")
    assert s.retention.get("W") is not None
    clock.advance(0.2)  # past break-even: released on expiry
    step(s)
    assert "W" not in s.retention and s.retention.stats.released_on_expiry == 1
    drain(s, clock)

    fcfs = make_scheduler("fcfs", num_blocks=400, block_size=16, clock=VirtualClock())
    add(fcfs, "w0", prompt, 2, wf="W", turn=0)
    finish(fcfs, "w0")
    assert "W" not in fcfs.retention  # fcfs never preserves
    drain(fcfs)


def test_infercept_other_running_calls_raise_the_discard_cost():
    clock = VirtualClock()
    s = make_scheduler("infercept", num_blocks=400, block_size=16, clock=clock)
    add(s, "big", ids(3, 1200), 50, wf="X", turn=0, last=True)
    add(s, "w0", ids(4, 300), 2, wf="W", turn=0)
    finish(s, "w0")
    d = s.mars_policy.last_decision
    assert d.other >= 1200  # C_other: the running batch
    assert s.retention.get("W").expires == pytest.approx(0.0002 * (d.context + d.other))
    drain(s, clock)


def test_infercept_swap_refuses_cpu_and_prefers_swap_over_long_preservation():
    with pytest.raises(ValueError, match="CPU-offload connector"):
        make_scheduler("infercept_swap", num_blocks=64)
    # Without an engine the load time is InferCept's 4e-5 s/token: T_load(C) * C (tests/test_sim_offload.py
    # prices the sim tier's own link).
    pol = make_policy("infercept_swap")
    assert isinstance(pol, InferceptSwapPolicy)
    assert pol.swap_waste(1000, 3000) == pytest.approx(4e-5 * 1000 * 1000)
    pol.check_platform("cuda")  # accepted on GPU


# -- continuum ------------------------------------------------------------------------------------
@pytest.mark.parametrize("gap, pinned", [(0.5, True), (2.5, False)])
def test_continuum_pins_for_two_seconds_only_for_short_tools(gap, pinned):
    clock = VirtualClock()
    s = make_scheduler("continuum", num_blocks=400, block_size=16, clock=clock)
    held = _run_workflow(s, clock, "W", turns=4, gap=gap, seed=11, tool="ls")
    assert held[0] == pytest.approx(2.0)  # tool never seen: mean 0 -> pinned
    assert held[1] == held[2] == (2.0 if pinned else 0.0), held
    stats = s.retention.stats
    if pinned:
        assert stats.released_on_return >= 2  # unpinned when the next call is scheduled
    drain(s, clock)


def test_continuum_unpins_on_expiry_and_latest_program_first_under_pressure():
    clock = VirtualClock()
    # 40 usable blocks: three programs pin 10 blocks each, then a newcomer needs 26.
    s = make_scheduler("continuum", num_blocks=41, block_size=16, clock=clock)
    for i, wf in enumerate(("P1", "P2", "P3")):
        add(s, f"{wf}-0", ids(20 + i, 160), 1, wf=wf, turn=0)
        finish(s, f"{wf}-0")
    assert len(s.retention) == 3 and s.retention.num_blocks == 30
    add(s, "new", ids(30, 400), 1, wf="N", turn=0, last=True)
    finish(s, "new")
    # pressure released the latest programs' pins first: P3, then P2; P1 kept
    assert "P1" in s.retention and "P2" not in s.retention and "P3" not in s.retention
    assert s.retention.stats.released_under_pressure == 2
    clock.advance(2.01)
    step(s)
    assert len(s.retention) == 0 and s.retention.stats.released_on_expiry == 1
    drain(s, clock)


def _program_order_rig(policy: str):
    clock = VirtualClock()
    s = make_scheduler(policy, num_blocks=400, block_size=16, max_num_batched_tokens=128, clock=clock)
    add(s, "a0", ids(40, 100), 1, wf="A", turn=0)
    finish(s, "a0")
    add(s, "b0", ids(41, 300), 1, wf="B", turn=0, last=True)  # B's program arrives after A's
    clock.advance(5.0)  # A's pin (2 s; infercept: break-even 0.02 s) is over
    add(s, "a1", ids(40, 100) + [OUT] + ids(42, 200), 1, wf="A", turn=1, last=True)
    return s, clock


@pytest.mark.parametrize("policy", ["continuum", "infercept"])
def test_continuum_and_infercept_order_by_program_arrival(policy):
    s, clock = _program_order_rig(policy)
    got = first_scheduled(s)
    # b0 was waiting since before a1 arrived, but A's program (infercept: its request) is older
    assert "a1" in got and "b0" not in got, got
    drain(s, clock)
    fcfs, clock = _program_order_rig("fcfs")
    got = first_scheduled(fcfs)
    assert "b0" in got and "a1" not in got, got
    drain(fcfs, clock)


def test_continuum_survives_a_lone_request_that_cannot_allocate():
    clock = VirtualClock()
    s = make_scheduler("continuum", num_blocks=21, block_size=16, clock=clock)  # 20 usable blocks
    add(s, "p0", ids(50, 160), 1, wf="P", turn=0)
    finish(s, "p0")
    assert s.retention.num_blocks == 10
    # a lone request that outgrows the free blocks while decoding: the pin goes, no IndexError
    add(s, "lone", ids(51, 100), 120, wf="L", turn=0, last=True)
    finish(s, "lone")
    assert s.retention.stats.released_under_pressure == 1
    drain(s, clock)


# -- continuum_dy ---------------------------------------------------------------------------------
def test_continuum_dy_cold_start_then_tau_from_the_utility_over_observed_gaps():
    clock = VirtualClock()
    s = make_scheduler("continuum_dy", num_blocks=400, block_size=16, clock=clock)
    pol = s.mars_policy
    # cold start: 2 s until 100 gaps were observed
    for i in range(101):
        wf = f"w{i}"
        add(s, f"{wf}-0", ids(60 + i, 16), 1, wf=wf, turn=0)
        finish(s, f"{wf}-0")
        entry = s.retention.get(wf)
        if i < 100:
            assert entry is not None and entry.expires - clock.now() == pytest.approx(2.0), i
        else:  # 100 gaps seen: the utility decides, and a 17-token context is not worth a pin
            assert entry is None
        clock.advance(0.3)  # every tool call takes 0.3 s
        add(s, f"{wf}-1", ids(60 + i, 16) + [OUT] + ids(1, 16), 1, wf=wf, turn=1, last=True, tool="ls")
        finish(s, f"{wf}-1")
    assert len(pol.gaps.all_samples()) == 101
    assert pol.queue_delay_s == 0.0 and pol.eta == pytest.approx(1.0)  # one shape of workflow
    # base = T * eta + reload(C) = 0.0002 s/token * C; u(0.3) = base - 0.3 > 0 iff C > 1500
    add(s, "long-0", ids(70, 2000), 1, wf="long", turn=0, tool="ls")
    finish(s, "long-0")
    assert s.retention.get("long").expires - clock.now() == pytest.approx(0.3)
    add(s, "short-0", ids(71, 1000), 1, wf="short", turn=0, tool="ls")
    finish(s, "short-0")
    assert "short" not in s.retention  # utility of pinning is negative: no pin
    drain(s, clock)


def test_continuum_dy_utility_and_memoryfulness_math():
    assert best_tau([0.1, 0.2, 5.0], base=1.0) == pytest.approx(0.2)  # 2/3 - 0.2 beats 1/3 - 0.1
    assert best_tau([0.1, 0.2, 5.0], base=0.1) == 0.0
    assert best_tau([1.0, 1.0, 1.0, 9.0], base=2.0) == pytest.approx(1.0)  # ties share one CDF step
    eta = _Eta()
    eta.add_workflow(5)
    assert eta.value(0.7) == pytest.approx(1.0)  # k + (N - k) = N: perfectly anti-correlated
    eta.add_workflow(20)
    assert 0.0 < eta.value(0.7) < 1.0
    assert _Eta().value(0.7) == 0.7


# -- lightllm -------------------------------------------------------------------------------------
def _lightllm_rig(policy: str, b_prompt: int):
    s = make_scheduler(policy, num_blocks=101, block_size=16, clock=VirtualClock())  # 1600 tokens
    add(s, "a", ids(80, 400), 600)
    step(s)  # a: prefill + first token -> has_run 401, left 598
    add(s, "b", ids(81, b_prompt), 301)  # left 300
    return s


@pytest.mark.parametrize("b_prompt, admitted", [(598, True), (599, False)])
def test_lightllm_admits_exactly_when_the_peak_fits(b_prompt, admitted):
    s = _lightllm_rig("lightllm", b_prompt)
    peak = peak_demand([(598, 401), (300, b_prompt)])  # max(598 + 401, 2 * 300 + 401 + b)
    assert peak == 1001 + b_prompt
    got = first_scheduled(s)
    assert ("b" in got) == admitted, (got, peak)
    assert s.mars_policy.last_peak == peak
    if not admitted:  # held until a finishes (a's growth keeps the peak above capacity)
        while "a" in s.requests:
            assert "b" not in s.running
            step(s)
        step(s)
        assert s.requests["b"] in s.running
    drain(s)

    fcfs = _lightllm_rig("fcfs", b_prompt)
    assert "b" in first_scheduled(fcfs)  # the prompt fits the free blocks: fcfs admits
    drain(fcfs)


# -- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, options, field", [
    ("autellix", {"quanta_s": [1.0]}, "quanta_s"),
    ("autellix", {"service_thresholds_s": [2.0, 1.0]}, "service_thresholds_s"),
    ("autellix", {"beta": 0}, "beta"),
    ("infercept", {"prefill_s_per_token": -1}, "prefill_s_per_token"),
    ("infercept_swap", {"swap_s_per_token": -1}, "swap_s_per_token"),
    ("continuum", {"pin_s": -2}, "pin_s"),
    ("continuum_dy", {"min_samples": 0}, "min_samples"),
    ("continuum_dy", {"pin_s": 2.0}, "valid keys"),  # continuum's key is not continuum_dy's
    ("lightllm", {"router_token_ratio": 2.0}, "router_token_ratio"),
])
def test_bad_baseline_config_names_the_field(policy, options, field):
    with pytest.raises(ValueError, match=field):
        make_policy(policy, options)


def test_autellix_accepts_json_lists():
    pol = make_policy("autellix", {"service_thresholds_s": [1, 2], "quanta_s": [1, 2, 3]})
    assert pol.config.service_thresholds_s == (1.0, 2.0) and pol.entry_level(1.5) == 1
