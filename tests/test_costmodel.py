"""The one CostModel: constructors, serialisation, and the scheduler's online fit in the rig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_mars.clock import VirtualClock
from vllm_mars.costmodel import CostModel, OnlineCostFit, from_polynomial
from vllm_mars.engine.rig import assert_no_leaks, fake_model_output, make_request, make_scheduler
from vllm_mars.policies import make_policy
from vllm_mars.sim.profile import load_cost_model, load_profile


class _Profile:
    name = "linear-test"
    max_num_batched_tokens = 8192
    max_model_len = 65536

    def step_seconds(self, prefill, decode):
        return (0.01 + sum(2e-5 * n + 1e-9 * n * (c + (n - 1) / 2) for n, c in prefill)
                + sum(3e-4 + 1e-8 * c for c in decode))


def test_fit_steps_recovers_the_step_model():
    p = _Profile()
    m = CostModel.fit_steps(p.step_seconds, budget=p.max_num_batched_tokens, max_len=p.max_model_len,
                            source=f"fitted to {p.name}")
    assert m.calibrated and "linear-test" in m.source
    assert m.step_overhead_s == pytest.approx(0.01, rel=1e-3)
    assert m.prefill_s_per_token == pytest.approx(2e-5, rel=1e-3)
    assert m.attn_s_per_token_ctx == pytest.approx(1e-9, rel=1e-3)
    assert m.decode_s == pytest.approx(3e-4, rel=1e-3) and m.decode_s_per_ctx_token == pytest.approx(1e-8, rel=1e-3)
    # The knee: the step's fixed 10 ms is worth 500 prefill tokens at 20 us each, a little fewer with
    # the attention of a half-budget chunk on the line that measures it.
    assert 430 < m.free_chunk_tokens < 500 and m.free_prefill_tokens() == int(m.free_chunk_tokens)
    assert m.step_s([(4096, 10000)], [100, 5000]) == pytest.approx(p.step_seconds([(4096, 10000)], [100, 5000]),
                                                                  rel=1e-4)


def test_serialisation_round_trip_and_file(tmp_path):
    m = from_polynomial(1e-4, 1e-9, 0.002, source="paper")
    assert CostModel.from_dict(m.as_dict()) == m
    assert m.rebuild_s(1000) == pytest.approx(1e-4 * 1000 + 1e-9 * 1000 * 999)
    f = tmp_path / "cost.json"
    f.write_text(json.dumps(m.as_dict()))
    assert CostModel.load(str(f)) == m
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="bad.json:1: not JSON"):
        CostModel.load(str(bad))
    # the ground floor reads cost models only; a profile's comes through the profile (no import upward)
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps(load_profile("h100-qwen3-32b").to_dict()))
    with pytest.raises(ValueError, match="not a serialised cost model .*load_cost_model"):
        CostModel.load(str(prof))
    assert load_cost_model(str(f)) == m
    assert load_cost_model("h100-qwen3-32b") == load_profile("h100-qwen3-32b").cost_model()
    code = (Path(__file__).parents[1] / "vllm-mars" / "vllm_mars" / "costmodel.py").read_text()
    assert "import" not in "".join(line for line in code.splitlines() if "vllm_mars" in line)
    with pytest.raises(ValueError, match="free prefill"):
        CostModel(prefill_s_per_token=0.0)


def test_free_prefill_tokens_from_solo_calls():
    # A GPU-like prefill: a 20 ms floor (the weight read) that chunks ride until their compute
    # (10 us/token) passes it, plus attention that grows with the prompt.
    def prefill(n: int) -> float:
        return max(0.020, 1e-5 * n) + 1e-9 * n * n

    decode = (33, prefill(8192) + 32 * 0.006)
    m = CostModel.from_solo_calls((32, prefill(32)), (8192, prefill(8192)), decode)
    # Without the mid-size prefill: the long line's intercept over its slope (attention makes the
    # slope steep and the knee early) ...
    assert m.free_chunk_tokens == 0 and m.free_prefill_tokens() == int(m.call_overhead_s / m.prefill_s_per_token)
    assert m.free_prefill_tokens() < 1300
    # ... with it: on the line through the short and the mid prefill, nearer the 2000-token knee.
    m2 = CostModel.from_solo_calls((32, prefill(32)), (8192, prefill(8192)), decode, mid=(4096, prefill(4096)))
    assert 1800 < m2.free_prefill_tokens() < 2400, m2.free_prefill_tokens()
    # The T_ideal model is the same; the measured knee travels with it.
    assert (m2.prefill_s_per_token, m2.call_overhead_s, m2.decode_s) == (m.prefill_s_per_token, m.call_overhead_s,
                                                                         m.decode_s)
    assert CostModel.from_dict(m2.as_dict()).free_prefill_tokens() == m2.free_prefill_tokens()
    # A mid prefill no slower than the short one measures nothing (the intercept rule stays).
    flat = CostModel.from_solo_calls((32, 0.02), (8192, 0.2), decode, mid=(4096, 0.02))
    assert flat.free_chunk_tokens == 0
    with pytest.raises(ValueError, match="P1 < Pm < P2"):
        CostModel.from_solo_calls((32, 0.02), (8192, 0.2), decode, mid=(9000, 0.3))


def test_uncalibrated_default_says_so():
    assert not CostModel().calibrated and "uncalibrated" in CostModel().source
    assert not make_policy("mars").cost.calibrated
    assert not make_policy("infercept").cost.calibrated
    p = make_policy("infercept", {"prefill_s_per_token": 1e-5})
    assert p.cost.calibrated and p.cost_pinned and p.cost.rebuild_s(100) == pytest.approx(1e-3)


def test_online_fit_of_synthetic_steps():
    fit = OnlineCostFit(min_steps=8)
    for i in range(200):
        n, d = (i * 37) % 1024, i % 9
        fit.observe(0.008 + 6e-5 * n + 1e-3 * d, [(n, 0)] if n else [], d)
    m = fit.model()
    assert m is not None and m.prefill_s_per_token == pytest.approx(6e-5, rel=0.02)
    assert m.step_overhead_s == pytest.approx(0.008, rel=0.05) and m.decode_s == pytest.approx(1e-3, rel=0.05)


def test_scheduler_fits_the_policy_cost_model_from_its_step_times():
    # Each step takes 5 ms + 50 us per scheduled token of virtual time; the policy starts on the
    # uncalibrated default and ends with the online fit (a calibrated model pinned from outside
    # would stop it).
    clock = VirtualClock()
    s = make_scheduler("mars", clock=clock, num_blocks=400, max_num_batched_tokens=128)
    assert not s.mars_policy.cost.calibrated
    for i in range(60):
        s.add_request(make_request(f"r{i}", prompt_len=100 + 37 * i % 300, max_tokens=4))
    while s.has_requests():
        so = s.schedule()
        clock.advance(0.005 + 5e-5 * so.total_num_scheduled_tokens)
        s.update_from_output(so, fake_model_output(s, so))
    cost = s.mars_policy.cost
    assert cost.calibrated and cost.source.startswith("online fit"), cost
    assert cost.prefill_s_per_token == pytest.approx(5e-5, rel=0.1)
    assert s.mars_stats()["cost_model"]["source"] == cost.source
    s.release_retention()
    assert_no_leaks(s)


@pytest.mark.parametrize("depth", [1, 2])
def test_async_scheduler_fits_the_cost_model_from_the_device_step_times(depth):
    """Async scheduling (vLLM's default on GPU): step N+1 is scheduled while N runs on the device and
    N's output is processed after that. The device runs the steps back to back, 5 ms + 50 us per
    scheduled token each; the host spends 0.3 ms scheduling. The fit must see the device's step
    times, not the gaps between a schedule and its output (which span the step before too)."""
    from collections import deque

    from vllm_mars.engine.scheduler import AsyncMarsScheduler

    class Recorder(OnlineCostFit):
        def __init__(self):
            super().__init__()
            self.seen = []

        def observe(self, seconds, prefill, num_decode):
            self.seen.append((seconds, sum(n for n, _ in prefill) + num_decode))
            super().observe(seconds, prefill, num_decode)

    clock = VirtualClock()
    s = make_scheduler("mars", clock=clock, num_blocks=400, max_num_batched_tokens=128,
                       scheduler_cls=AsyncMarsScheduler)
    assert isinstance(s, AsyncMarsScheduler) and not s.mars_policy.cost.calibrated
    assert s._cost.fit is not None  # the online fit runs under async scheduling too
    s._cost.fit = fit = Recorder()
    for i in range(60):
        s.add_request(make_request(f"r{i}", prompt_len=100 + 37 * i % 300, max_tokens=4))
    in_flight: deque = deque()
    device_free = 0.0
    overlapped = 0
    while s.has_requests() or in_flight:
        if s.has_requests() and len(in_flight) <= depth:
            so = s.schedule()
            out = fake_model_output(s, so)  # computed at launch, as the rig's engine core does
            tokens = so.total_num_scheduled_tokens
            start = max(clock.now(), device_free)
            device_free = start + (0.005 + 5e-5 * tokens if tokens else 0.0)
            in_flight.append((so, out, device_free))
            clock.advance(0.0003)
            if len(in_flight) <= depth and s.has_requests():
                continue
        overlapped += len(in_flight) > 1
        so, out, done = in_flight.popleft()
        clock.set(max(clock.now(), done))
        s.update_from_output(so, out)
    assert overlapped > 50  # the steps did run while their successors were scheduled
    work = [(t, n) for t, n in fit.seen if n]
    assert len(work) > 50
    for t, n in work:
        assert t == pytest.approx(0.005 + 5e-5 * n, abs=1e-9), (t, n)
    cost = s.mars_policy.cost
    assert cost.calibrated and cost.source.startswith("online fit"), cost
    assert cost.prefill_s_per_token == pytest.approx(5e-5, rel=0.15)
    s.release_retention()
    assert_no_leaks(s)


@pytest.mark.parametrize("pin", [False, True, "after calibration calls"])
def test_uncalibrated_warning_comes_at_the_first_step_and_not_when_the_driver_pins_a_model_first(caplog, pin):
    """The driver pins its calibration right after the engine starts (the in-process engine after
    calibration calls on itself, with the warning deferred for them): no warning then; without one
    the first step that schedules work says so, once."""
    import logging

    clock = VirtualClock()

    def serve(prefix):
        for i in range(6):
            s.add_request(make_request(f"{prefix}{i}", prompt_len=100, max_tokens=2))
        while s.has_requests():
            so = s.schedule()
            clock.advance(0.005)
            s.update_from_output(so, fake_model_output(s, so))

    def warned():
        return [r.getMessage() for r in caplog.records if "UNCALIBRATED" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="vllm_mars.engine.scheduler"):
        s = make_scheduler("mars", clock=clock, num_blocks=400, max_num_batched_tokens=128)
        s.schedule()  # nothing to schedule yet: not a step that prices anything
        assert not warned()
        if pin == "after calibration calls":
            s.defer_cost_warning(True)
            serve("cal")  # steps with work, but the driver's, before it pins
            s.defer_cost_warning(False)
            assert not warned()
        if pin:
            s.set_cost_model(CostModel(prefill_s_per_token=5e-5, source="test calibration", calibrated=True))
        serve("r")
    assert len(warned()) == (0 if pin else 1), warned()
    assert s.mars_stats()["cost_model"]["source"] == ("test calibration" if pin else s.mars_policy.cost.source)
    s.release_retention()
    assert_no_leaks(s)
