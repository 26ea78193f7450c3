"""Admission controllers, one test per rule, on plain data with an injected clock (SPEC section 4)."""

from __future__ import annotations

import math

import pytest
from vllm_mars.admission.base import NoneController, PendingRoot, Telemetry, make_controller
from vllm_mars.admission.concur import ConcurConfig, ConcurController
from vllm_mars.admission.mars import MarsAdmissionConfig, MarsAdmissionController
from vllm_mars.admission.mars.cost import fit_wait_s, rebuild_cost_s
from vllm_mars.admission.mars.projection import life_peak, marginal_overflow, projection


def tel(ts, free=1000, total=1000, bs=16, usage=None, inflight=None, workers=None, wait=None, hit=None):
    return Telemetry(ts=ts, free_blocks=free, total_blocks=total, block_size=bs, kv_usage=usage,
                     tools_in_flight=inflight, tool_workers=workers, tool_queue_wait_s=wait, prefix_hit_rate=hit)


def mars(**kw) -> MarsAdmissionController:
    return MarsAdmissionController(MarsAdmissionConfig(**kw))


def offer(c, name, t=0.0, tokens=160):
    c.offer(PendingRoot(name, t, tokens))


def events(c, kind):
    return [e for e in c.take_events() if e.event == kind]


# -- MARS: guard margin and budget -----------------------------------------------------------------
def test_guard_margin_budget():
    c = mars()
    c.observe(tel(0, free=500, total=1000))
    assert c.budget_blocks() == 500 - math.ceil(1000 * (1 - 0.9))
    c.observe(tel(1, free=0, total=1000))
    assert c.budget_blocks() == 0  # zero free blocks is a zero budget, not "unknown"
    c.observe(tel(2, free=None, total=1000))
    assert c.budget_blocks() is None


def test_budget_counts_promised_blocks_until_telemetry_catches_up():
    c = mars(window_min=8, window_max=8, promise_s=1.0)
    c.observe(tel(0, free=200, total=1000))  # budget 100
    for i in range(3):
        offer(c, f"r{i}", tokens=16 * 40)  # 40 blocks each
    assert c.tick(0.0) == ["r0", "r1"]  # 80 of 100 promised, r2 does not fit
    assert c.budget_blocks() == 20
    c.observe(tel(0.5, free=200, total=1000))  # too early to show them: promises still count
    assert c.tick(0.5) == []
    c.observe(tel(1.5, free=120, total=1000))  # now shows the 80 blocks: promises dropped
    assert c.budget_blocks() == 20
    c.finish("r0", 1.6)
    c.observe(tel(1.7, free=160, total=1000))
    assert c.tick(1.7) == ["r2"]


# -- MARS: AIMD window -----------------------------------------------------------------------------
def test_window_additive_increase_once_per_interval():
    c = mars(window_min=4, window_max=10)
    c.observe(tel(0, usage=0.5))
    c.tick(0.0)
    assert c.window == 5
    c.tick(0.1)  # within the interval: no change
    assert c.window == 5
    c.tick(0.2)
    assert c.window == 6
    ev = events(c, "admission_window")
    assert [e.data["new"] for e in ev] == [5, 6] and ev[0].data["kv_usage"] == 0.5


def test_window_multiplicative_decrease_on_kv_high_and_hysteresis():
    c = mars(window_min=4, window_max=30, window_init=20)
    c.observe(tel(0, usage=0.92, free=80))
    c.tick(0.0)
    assert c.window == 4  # floor(20*0.7)=14, then the KV cap at usage >= kv_high is window_min
    p = events(c, "admission_pressure")
    assert any(e.data["kind"] == "kv" and e.data["overloaded"] for e in p)
    c.observe(tel(0.2, usage=0.87, free=130))  # between the marks: still overloaded (hysteresis)
    c.tick(0.2)
    assert c._kv_overloaded and c.window == 4
    c.observe(tel(0.4, usage=0.80, free=200))
    c.tick(0.4)
    assert not c._kv_overloaded and c.window == 5


def test_kv_cap_linear_between_watermarks():
    c = mars(window_min=4, window_max=24, window_init=24)
    c.observe(tel(0, usage=0.875, free=125))  # halfway between 0.85 and 0.9
    assert c.limit() == 14


def test_the_cpu_plane_only_caps_the_window():
    # A long tool queue wait and a backlog of 2 calls per worker are no pressure: no decrease, no
    # hold, no pressure event (the wait rule was retired: experiments/paper/README.md, "The CPU-tool
    # cell"); the window grows as on a healthy tick and the cap ceil(workers x 1.5) bounds the limit.
    c = mars(window_min=4, window_max=30, window_init=20)
    for i in range(5):
        c.observe(tel(i * 0.2, usage=0.1, inflight=32, workers=16, wait=60.0 + i))
        c.tick(i * 0.2)
    assert c.window == 24 and c.limit() == 24  # 20 + 4 increases, then the cap ceil(16 x 1.5)
    assert not events(c, "admission_pressure")
    c.observe(tel(1.0, usage=0.1, inflight=32, workers=8, wait=70.0))
    c.tick(1.0)
    assert c.window == c.limit() == 12  # fewer workers: the cap falls with them
    ev = events(c, "admission_window")
    assert ev[-1].data["cpu_cap"] == 12 and ev[-1].data["cpu_backlog_ratio"] == 4.0


def test_retired_cpu_options_are_refused():
    for field in ("cpu_wait_high_s", "cpu_wait_low_s", "cpu_backlog_low"):
        with pytest.raises(ValueError, match=field):
            make_controller("mars", {field: 5.0})


def test_cpu_cap():
    c = mars(window_min=4, window_max=30, window_init=30)
    c.observe(tel(0, usage=0.1, inflight=0, workers=4))
    assert c.limit() == math.ceil(4 * 1.5)


def test_window_bounds():
    c = mars(window_min=4, window_max=6, window_init=6)
    c.observe(tel(0, usage=0.1))
    for i in range(10):
        c.tick(i * 0.2)
    assert c.window == 6
    for i in range(10, 30):
        c.observe(tel(i * 0.2, usage=0.99, free=10))
        c.tick(i * 0.2)
    assert c.window == 4


# -- MARS: telemetry states --------------------------------------------------------------------------
def test_missing_telemetry_admits_small_fixed_window():
    c = mars(no_telemetry_window=2)
    for i in range(5):
        offer(c, f"r{i}", t=i)
    assert c.tick(5.0) == ["r0", "r1"]
    c.finish("r0", 6.0)
    assert c.tick(6.0) == ["r2"]
    assert all(e.data["mode"] == "no_telemetry_fcfs" for e in events(c, "admission_admit"))


def test_stale_telemetry_is_pressure():
    c = mars(window_min=4, window_max=30, window_init=20, stale_s=2.0)
    c.observe(tel(0, usage=0.1))
    c.tick(0.0)
    assert c.window == 21
    c.tick(2.5)  # last reading 2.5 s old
    assert c.window == 4  # x0.7 and the KV cap falls to window_min
    p = events(c, "admission_pressure")
    assert any(e.data["kind"] == "telemetry" and e.data["overloaded"] for e in p)
    c.observe(tel(2.6, usage=0.1))
    c.tick(2.7)
    assert c.window == 5


# -- MARS: selection ---------------------------------------------------------------------------------
def test_light_load_arrival_order():
    c = mars(window_min=8, window_max=8)
    c.observe(tel(0, free=1000))
    offer(c, "big", 0, tokens=1600)
    offer(c, "small", 1, tokens=16)
    assert c.tick(1.0) == ["big", "small"]
    assert {e.data["mode"] for e in events(c, "admission_admit")} == {"light_fcfs"}


def test_contention_smallest_first_skips_nonfitting():
    c = mars(window_min=2, window_max=2)
    c.observe(tel(0, free=200, total=1000))  # budget 100
    offer(c, "a", 0, tokens=16 * 150)  # 150 blocks: never fits
    offer(c, "b", 1, tokens=16 * 30)
    offer(c, "c", 2, tokens=16 * 10)
    assert c.tick(2.0) == ["c", "b"]
    ev = events(c, "admission_admit")
    assert [e.data["mode"] for e in ev] == ["smallest_fit", "smallest_fit"]
    assert ev[0].data["footprint_blocks"] == 10 and ev[1].data["kv_budget_remaining"] == 60


def test_a_congested_tool_plane_keeps_the_selection_order():
    # No largest-first order while tools queue (retired with the wait rule): smallest fit first.
    c = mars(window_min=1, window_max=1, window_init=1)
    c.observe(tel(0, free=1000, inflight=40, workers=4, wait=60.0))
    offer(c, "small", 0, tokens=16)
    offer(c, "large", 1, tokens=1600)
    assert c.tick(1.0) == ["small"]
    assert events(c, "admission_admit")[0].data["mode"] == "smallest_fit"


def test_zero_budget_admits_oldest_alone_only_when_idle():
    c = mars(window_min=4, window_max=4)
    c.observe(tel(0, free=50, total=1000))  # budget 0
    offer(c, "a", 0)
    offer(c, "b", 1)
    assert c.tick(1.0) == ["a"]
    assert c.tick(1.1) == []  # a is active: b waits for budget
    c.finish("a", 2.0)
    assert c.tick(2.0) == ["b"]


def test_draining_long_roots():
    c = mars(window_min=8, window_max=8, long_prefill_tokens=1000)
    c.observe(tel(0, free=500, total=1000))  # budget 400 blocks
    offer(c, "l1", 0, tokens=16 * 100)
    offer(c, "l2", 1, tokens=16 * 500)  # does not fit: skipped, not blocking
    offer(c, "l3", 2, tokens=16 * 100)
    assert c.tick(2.0) == ["l1", "l3"]  # nothing active yet: fill within the budget
    assert all(e.data["mode"] == "drain_fit" for e in events(c, "admission_admit"))
    c.finish("l1", 3.0)
    c.finish("l3", 3.0)
    c.observe(tel(3.0, free=500, total=1000))
    assert c.tick(3.0) == ["l2"]  # none fits, none active: the oldest alone
    assert events(c, "admission_admit")[0].data["mode"] == "drain_oldest_alone"


def test_draining_one_at_a_time_while_active():
    c = mars(window_min=8, window_max=8, long_prefill_tokens=1000, promise_s=0.0)
    c.observe(tel(0, free=900, total=1000))
    offer(c, "l0", 0, tokens=16 * 100)
    assert c.tick(0.0) == ["l0"]
    for i in range(1, 4):
        offer(c, f"l{i}", i, tokens=16 * 100)
    c.observe(tel(4.0, free=800, total=1000))
    assert c.tick(4.0) == ["l1"]


def test_freed_slot_refilled_on_tick_without_arrival():
    c = mars(window_min=1, window_max=1)
    c.observe(tel(0))
    offer(c, "a", 0)
    offer(c, "b", 0)
    assert c.tick(0.0) == ["a"]
    c.finish("a", 1.0)
    c.observe(tel(1.0))
    assert c.tick(1.05) == ["b"]  # no new arrival needed


def test_finish_of_queued_root_cancels_it():
    c = mars(window_min=1, window_max=1)
    c.observe(tel(0))
    offer(c, "a", 0)
    offer(c, "b", 0)
    c.tick(0)
    c.finish("b", 0.5)
    assert c.num_queued == 0 and c.num_active == 1


def test_turn_growth_refines_footprint():
    c = mars(window_min=4, window_max=4, growth_alpha=0.5)
    c.observe(tel(0, bs=16))
    offer(c, "a", 0, tokens=160)
    c.offer(PendingRoot("b", 0, 160, {"turns": 4}))  # the driver says how many turns
    c.tick(0)
    assert c.footprint_blocks(PendingRoot("x", 0, 160)) == 10  # nothing learned: the prefix alone
    c.finish("a", 1.0, final_tokens=480)  # no turn count: nothing to learn from
    assert c.turn_growth == 0
    c.finish("b", 1.0, final_tokens=800)  # (800 - 160) / 4 = 160 tokens per turn
    assert c.turn_growth == pytest.approx(80.0)  # EMA with alpha 0.5 from 0
    assert c.footprint_blocks(PendingRoot("x", 0, 160)) == 15  # ceil((160 + 80) / 16)
    offer(c, "c", 2, tokens=160)
    c.tick(2)
    c.finish("c", 3.0, final_tokens=480, turns=2)  # explicit turns: (480 - 160) / 2 = 160
    assert c.turn_growth == pytest.approx(120.0)


def test_unknown_prefill_uses_default():
    c = mars(unknown_prefill_tokens=320)
    c.observe(tel(0, bs=32))
    assert c.footprint_blocks(PendingRoot("x", 0, None)) == 10


def test_duplicate_offer_and_bad_config_rejected():
    c = mars()
    offer(c, "a")
    with pytest.raises(ValueError, match="already queued"):
        offer(c, "a")
    with pytest.raises(ValueError, match="window_max"):
        MarsAdmissionConfig(window_min=5, window_max=4)
    with pytest.raises(ValueError, match="size.*'life' or 'turn'"):
        make_controller("mars", {"size": "fast"})
    with pytest.raises(ValueError, match=r"unknown MarsAdmissionConfig key\(s\) \['queue_wait'\]"):
        make_controller("mars", {"queue_wait": "unkept"})  # retired (docs/history.md)
    with pytest.raises(ValueError, match="valid keys:"):
        MarsAdmissionConfig.from_dict({"windw": 3})
    with pytest.raises(ValueError, match="window_max must be int"):
        make_controller("mars", {"window_max": "abc"})
    with pytest.raises(ValueError, match="unknown ConcurConfig"):
        make_controller("concur", {"kv_target": 0.9})
    with pytest.raises(ValueError, match="available: cap, concur, mars, none"):
        make_controller("nope")


def test_randomized_invariants():
    import random

    rng = random.Random(7)
    c = mars(window_min=2, window_max=12)
    now, n, active = 0.0, 0, set()
    for _ in range(500):
        now += rng.random() * 0.1
        r = rng.random()
        if r < 0.3:
            offer(c, f"r{n}", now, tokens=rng.choice([None, 16, 1600, 80_000]))
            n += 1
        elif r < 0.5 and active:
            w = rng.choice(sorted(active))
            active.discard(w)
            c.finish(w, now, final_tokens=rng.randint(1, 5000))
        elif r < 0.8:
            c.observe(tel(now, free=rng.randint(0, 1000), usage=None, inflight=rng.randint(0, 20), workers=4))
        got = c.tick(now)
        active.update(got)
        assert c.num_active == len(active)
        # the limit holds except for the single starvation guard
        # the limit holds whenever anything was admitted (the starvation guard admits one when idle)
        assert not got or c.num_active <= c.limit() or c.num_active == 1
        assert not set(got) - {f"r{i}" for i in range(n)}
        if c._tel is not None:  # the incremental promise sum equals the definition
            brute = sum(a.blocks for a in c._active.values() if c._tel.ts < a.admitted_at + c.config.promise_s)
            assert c._promised() == brute
    finished = n - c.num_queued - len(active)
    assert finished >= 0 and c.num_admitted == len(active) + finished


# -- CONCUR ------------------------------------------------------------------------------------------
def test_concur_aimd():
    """The paper's Eq. 1 with its settings (alpha 2, beta 0.5, U_low 0.2, U_high 0.5, H_thresh 0.2):
    decrease needs high utilisation and a hit rate below the threshold, not a falling one."""
    c = ConcurController(ConcurConfig(window_min=1, window_max=20, window_init=4))
    c.observe(tel(0, usage=0.1, hit=0.5))
    c.tick(0)
    assert c.window == 6  # usage < u_low: +2
    c.observe(tel(0.2, usage=0.6, hit=0.5))
    c.tick(0.2)
    c.observe(tel(0.4, usage=0.6, hit=0.3))
    c.tick(0.4)
    assert c.window == 6  # above u_high, the hit rate fell but stays >= 0.2: hold
    c.observe(tel(0.6, usage=0.6, hit=0.15))
    c.tick(0.6)
    assert c.window == 3  # above u_high and hit rate < 0.2: x0.5
    c.observe(tel(0.8, usage=0.6, hit=0.15))
    c.tick(0.8)
    assert c.window == 1  # the hit rate stays low (not falling): x0.5 again
    c.observe(tel(1.0, usage=0.3, hit=0.1))
    c.tick(1.0)
    assert c.window == 1  # between the marks: hold
    c.observe(tel(1.2, usage=0.05, hit=None))
    c.tick(1.2)
    assert c.window == 3
    c.observe(tel(1.4, usage=0.55, hit=None))
    c.tick(1.4)
    assert c.window == 1  # an unknown hit rate counts as low
    assert [e.data["reason"] for e in c.take_events() if e.event == "admission_window"] == \
        ["increase", "decrease", "decrease", "increase", "decrease"]


def test_concur_defaults_are_the_papers_and_validated():
    cfg = ConcurConfig()
    assert (cfg.inc, cfg.dec_factor, cfg.u_low, cfg.u_high, cfg.hit_thresh) == (2, 0.5, 0.2, 0.5, 0.2)
    with pytest.raises(ValueError, match=r"ConcurConfig.hit_thresh = 1.5: must be in \[0, 1\]"):
        make_controller("concur", {"hit_thresh": 1.5})
    with pytest.raises(ValueError, match="unknown ConcurConfig"):
        make_controller("concur", {"hit_drop_tol": 0.01})


def test_concur_admits_fcfs_within_window_and_refills():
    c = ConcurController(ConcurConfig(window_min=2, window_max=2))
    c.observe(tel(0, usage=0.3))
    for i in range(4):
        offer(c, f"r{i}", i, tokens=[1600, 16, 16, 16][i])
    assert c.tick(4) == ["r0", "r1"]
    c.finish("r0", 5)
    assert c.tick(5) == ["r2"]


def test_concur_stale_and_missing():
    c = ConcurController(ConcurConfig(window_min=1, window_max=10, window_init=8, no_telemetry_window=3))
    for i in range(5):
        offer(c, f"r{i}", 0)
    assert c.tick(0) == ["r0", "r1", "r2"]  # no telemetry: fixed window
    c.observe(tel(0.1, usage=0.3, hit=0.5))
    c.tick(3.0)
    assert c.window == 4  # stale: decrease


def test_none_controller_admits_everything():
    c = NoneController()
    for i in range(50):
        offer(c, f"r{i}", 0)
    assert len(c.tick(0)) == 50 and c.num_active == 50
    c.finish("r3", 1)
    assert c.num_active == 49


# -- MARS: cost-aware admission --------------------------------------------------------------------
def _cost_scenario(cost, admit="cost"):
    """Two active roots (one finished after 4 s, so a root's active time is known); a 48-block pool
    with the budget spent; three more roots of 10 blocks each wait. Returns the ones admitted."""
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=2, window_max=8, admit=admit)
    if cost is not None:
        c.set_cost_model(CostModel(prefill_s_per_token=cost, source="test"))
    c.observe(tel(0, free=48, total=48, bs=32))
    for i in range(3):
        offer(c, f"a{i}", tokens=32 * 10)
    first = c.tick(0.0)
    c.finish(first[0], 4.0)
    c.observe(Telemetry(ts=4.0, free_blocks=2, total_blocks=48, block_size=32, running=2,
                        recomputed_tokens=0, kv_blocks_removed=0))
    for i in range(3):
        offer(c, f"q{i}", t=4.0, tokens=32 * 10)
    return first, c.tick(4.0), c


def test_cost_admission_is_work_conserving_when_rebuilds_are_cheap():
    # CPU tiny model: 7e-6 s/token, a 320-token overflow rebuilds in 2 ms per turn: far below the
    # ~2 s a queued root would wait for a slot. Every waiting root goes in.
    first, admitted, c = _cost_scenario(7e-6)
    assert len(first) == 3  # the window starts at window_max with a cost model (fits: 30 blocks)
    assert admitted == ["q0", "q1", "q2"], admitted
    ev = [e for e in c.take_events() if e.event == "admission_admit" and e.data["mode"] == "cost_overflow"]
    assert ev and ev[0].data["expected_rebuild_s"] < ev[0].data["expected_queue_s"]
    # Off (the footprint rules, mars-no-cost-admission): the same roots wait for the budget.
    _, held, _ = _cost_scenario(7e-6, admit="footprint")
    assert held == [], held


def test_cost_admission_holds_roots_when_rebuilds_are_expensive():
    # 2e-3 s/token: the same overflow costs 0.64 s per turn per stalled call, above the wait.
    _, admitted, _ = _cost_scenario(2e-3)
    assert admitted == []


def test_cost_admission_without_a_model_says_so_and_uses_footprints():
    _, admitted, c = _cost_scenario(None)
    assert admitted == []
    kinds = [e for e in c.take_events() if e.event == "admission_cost_model"]
    assert kinds and kinds[0].data["rule"] == "footprint" and kinds[0].data["calibrated"] is False


def test_cost_rule_window_shrinks_on_measured_rebuilds_only():
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=2, window_max=10, interval_s=0.2)
    c.set_cost_model(CostModel(prefill_s_per_token=1e-4, source="test"))
    assert c.window == 10
    # Full KV, no rebuilds: the window stays open (KV usage alone is no pressure).
    for k in range(5):
        c.observe(Telemetry(ts=k * 0.2, free_blocks=0, total_blocks=100, block_size=16,
                            recomputed_tokens=0, kv_blocks_removed=0))
        c.tick(k * 0.2)
    assert c.limit() == 10
    # Rebuilding 4000 tokens per 0.2 s at 1e-4 s/token = 2 engine-seconds per second: thrashing.
    for k in range(5, 10):
        c.observe(Telemetry(ts=k * 0.2, free_blocks=0, total_blocks=100, block_size=16,
                            recomputed_tokens=4000 * (k - 4), kv_blocks_removed=0))
        c.tick(k * 0.2)
    assert c.window < 10 and c.limit() < 10

@pytest.mark.parametrize("tokens", [3000, 200])
def test_rebuilds_shrink_the_window_only_where_the_pool_keeps_window_min_contexts(tokens):
    # One active root in a 1600-token pool, then 2 engine-seconds of rebuilds per second. A
    # 3000-token root (10 turns) does not fit the pool twice (window_min 2): every context is evicted
    # in its tool gaps however few roots are active, so the window stays open; a 200-token one
    # (one turn) fits it 8 times, and the window shrinks.
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=2, window_max=10, interval_s=0.2)
    c.set_cost_model(CostModel(prefill_s_per_token=1e-4, source="test"))
    c.observe(Telemetry(ts=0.0, free_blocks=100, total_blocks=100, block_size=16,
                        recomputed_tokens=0, kv_blocks_removed=0))
    c.offer(PendingRoot("a", 0.0, tokens, {"turns": 10 if tokens > 1000 else 1}))
    assert c.tick(0.0) == ["a"]
    for k in range(1, 10):
        c.observe(Telemetry(ts=k * 0.2, free_blocks=0, total_blocks=100, block_size=16,
                            recomputed_tokens=4000 * k, kv_blocks_removed=0))
        c.tick(k * 0.2)
    shrunk = tokens == 200
    assert (c.window < 10) == shrunk and c.snapshot()["kv_overloaded"] == shrunk


def test_registry_a_controller_is_only_its_rules_and_bool_options_work():
    """A controller registered with the decorator gets the queue, active set, events, promises and
    option validation from the base; bool options can be set (before: 'must be bool' for True)."""
    from dataclasses import dataclass

    from vllm_mars.admission import base

    @dataclass(frozen=True)
    class LifoConfig(base.WindowConfig):
        lifo: bool = False

    @base.register_controller
    class Lifo(base.ControllerBase):
        name = "test-lifo"
        config_cls = LifoConfig

        def tick(self, now):
            order = list(self._queue.values())
            if self.config.lifo:
                order.reverse()
            out = order[: max(0, self.window - self.num_active)]
            for r in out:
                self._admit(r, now, blocks=3, promise_s=1.0)
            return [r.workflow for r in out]

    try:
        c = make_controller("test-lifo", {"lifo": True, "window_init": 2, "window_max": 2})
        assert "test-lifo" in base.available_controllers()
        for i in range(3):
            offer(c, f"r{i}", i)
        assert c.tick(3) == ["r2", "r1"]
        assert c.promised_blocks() == 6 and c.promised_blocks(["r1"]) == 3
        c.observe(tel(4.5))  # a reading taken after the promises landed: they are no longer counted
        assert c.promised_blocks() == 0
        c.finish("r2", 5)
        assert c.tick(5) == ["r0"] and c.snapshot()["admitted"] == 3
        with pytest.raises(ValueError, match="lifo must be bool"):
            make_controller("test-lifo", {"lifo": 1})
    finally:
        base._REGISTRY.pop("test-lifo", None)


@pytest.mark.parametrize("name,opt", [("mars", "stale_s"), ("concur", "interval_s"), ("mars", "kv_target")])
def test_non_finite_controller_options_are_rejected(name, opt):
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match=f"{opt} must be a finite number"):
            make_controller(name, {opt: bad})
    with pytest.raises(ValueError, match="takes no options"):
        make_controller("none", {"x": 1})


# -- MARS: whole-life sizing -----------------------------------------------------------------------
def _life_scenario(size):
    """A 1000-block pool (16k tokens). Three 10-turn roots of 1600 tokens were admitted and each
    has shown three turns of 1600 tokens' growth: at 6400 tokens with 7 turns to go, each is
    projected to ~17.6k tokens, far past the pool together. A fourth root arrives while 600
    blocks are still free now. Returns what is admitted."""
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=1, window_max=16, size=size)
    c.set_cost_model(CostModel(prefill_s_per_token=1e-3, source="test"))  # rebuilds expensive
    c.observe(tel(0, free=1000, total=1000))
    for i in range(3):
        c.offer(PendingRoot(f"a{i}", 0.0, 1600, {"turns": 10}))
    assert c.tick(0.0) == ["a0", "a1", "a2"]
    for turn in (1, 2, 3):
        for i in range(3):
            c.update_estimate(f"a{i}", 1600 * (turn + 1), float(turn))
    c.observe(Telemetry(ts=3.0, free_blocks=600, total_blocks=1000, block_size=16, running=3,
                        recomputed_tokens=0, kv_blocks_removed=0))
    c.offer(PendingRoot("b", 3.0, 1600, {"turns": 10}))
    return c.tick(3.0), c


def test_life_sizing_learns_growth_from_active_roots_and_holds_a_root_that_would_outgrow_the_pool():
    admitted, c = _life_scenario("life")
    assert c.turn_growth == pytest.approx(1600)  # learned before any root finished
    assert admitted == []
    # Off ("turn": the prefix plus one turn of growth against the free blocks): admitted now.
    admitted, _ = _life_scenario("turn")
    assert admitted == ["b"]


def _three_roots_grown_by_100(**kw):
    """Three 10-turn roots of 1600 tokens admitted into a 1000-block pool (16k tokens), each shown
    one turn of 100 tokens' growth; at t=1, 600 blocks free. Rebuilds expensive (1 ms a token)."""
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=1, window_max=16, **kw)
    c.set_cost_model(CostModel(prefill_s_per_token=1e-3, source="test"))
    c.observe(tel(0, free=1000, total=1000))
    for i in range(3):
        c.offer(PendingRoot(f"a{i}", 0.0, 1600, {"turns": 10}))
    c.tick(0.0)
    for i in range(3):
        c.update_estimate(f"a{i}", 1700, 1.0)
    c.observe(tel(1.0, free=600, total=1000))
    return c


def test_life_sizing_admits_when_the_projection_fits():
    # The same roots at one turn each of 100 tokens' growth: 4 x (1600 + 100 x 10) fits 16k.
    c = _three_roots_grown_by_100()
    c.offer(PendingRoot("b", 1.0, 1600, {"turns": 10}))
    assert c.tick(1.0) == ["b"]
    ev = [e for e in c.take_events() if e.event == "admission_admit" and e.data["workflow"] == "b"]
    assert ev[0].data["life_peak_tokens"] <= ev[0].data["life_capacity_tokens"]
    # A root that finished frees its projection: the learned per-turn growth stays.
    c.finish("a0", 2.0, final_tokens=3000)
    assert c.turn_growth == pytest.approx(100)


def test_life_peak_is_reached_just_before_a_root_ends():
    # remaining turns, context: at tau=5 both live (100+50 + 200+50); at tau=8 only the first.
    assert life_peak([(8.0, 100.0), (5.0, 200.0)], 10.0) == pytest.approx(max(100 + 80, 300 + 2 * 50))
    assert life_peak([], 10.0) == 0.0


def _third_root(pool, free_then, s_per_token, b_tokens=3000, waiting=None, **kw):
    """Two 10-turn 3000-token roots admitted at t=0 into a ``pool``-block pool (16-token blocks)
    show 400 tokens of growth; root b (``b_tokens``, 10 turns) arrives at t=100 with ``free_then``
    blocks free, rebuilds priced at ``s_per_token``. Returns (b's first tick, the controller)."""
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=1, window_max=16, **kw)
    c.set_cost_model(CostModel(prefill_s_per_token=s_per_token, source="test"))
    c.observe(tel(0, free=pool, total=pool))
    for i in range(2):
        c.offer(PendingRoot(f"a{i}", 0.0, 3000, {"turns": 10}))
    assert c.tick(0.0) == ["a0", "a1"]
    for i in range(2):
        c.update_estimate(f"a{i}", 3400, 50.0)
    c.observe(Telemetry(ts=100.0, free_blocks=free_then, total_blocks=pool, block_size=16, running=2,
                        waiting=waiting, recomputed_tokens=0, kv_blocks_removed=0))
    c.offer(PendingRoot("b", 100.0, b_tokens, {"turns": 10}))
    return c.tick(100.0), c


def _admit_event(c, workflow="b"):
    ev = [e for e in c.take_events() if e.event == "admission_admit" and e.data["workflow"] == workflow]
    return ev[0].data


def test_overflow_priced_per_turn_admits_a_root_whose_overflow_comes_only_at_the_end():
    # A 1000-block pool (16k tokens): the two active roots (3400 tokens, 9 turns to go: 2 x 7000 at
    # their end) and b (3000 tokens, 10 turns) pass the pool only from their 6th coming turn on (by
    # 1000, 2200, 3400 and 4600 tokens at turns 6-9). Rebuilds at 1 ms per token stall 3 calls: (1000
    # + 2200 + 3400 + 4600) tokens x 1 ms x 3 = 34 s, below the 50 s to the next slot (100 s / 2
    # active). Priced at the peak for every turn it would be 10 x 4.6 s x 3 = 138 s: held.
    admitted, c = _third_root(1000, 600, 1e-3)
    assert admitted == ["b"]
    ev = _admit_event(c)
    assert ev["mode"] == "cost_overflow" and ev["overflow_turns"] == 4
    assert ev["expected_rebuild_s"] == pytest.approx(3 * 1e-3 * (1000 + 2200 + 3400 + 4600), rel=0.01)


def test_projection_by_turn_and_the_candidates_marginal_overflow():
    # remaining turns, context: both live through turn 5, only the first through turns 6-8
    items = [(8.0, 100.0), (5.0, 200.0)]
    assert projection(items, 10.0) == pytest.approx([320, 340, 360, 380, 400, 160, 170, 180])
    grown = sorted([*items, (3.0, 50.0)], reverse=True)
    # with cap 380: before, turn 5 is over by 20 (not the candidate's); the candidate adds 50 + 10 k
    # at turns 1-3: 380 (fits), 410 and 440
    assert marginal_overflow(items, grown, 380.0, 10.0) == pytest.approx([0, 30, 60, 0, 0, 0, 0, 0])
    assert projection([], 10.0) == []


def _expensive_hold(**kw):
    """Rebuilds at 2 ms per token: two active 10-block roots (one finished after 4 s), the 48-block
    pool spent, and root q arriving at t=4. Returns the controller and q's first tick."""
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=2, window_max=8, **kw)
    c.set_cost_model(CostModel(prefill_s_per_token=2e-3, source="test"))
    c.observe(tel(0, free=48, total=48, bs=32))
    for i in range(3):
        offer(c, f"a{i}", tokens=32 * 10)
    c.finish(c.tick(0.0)[0], 4.0)
    c.observe(Telemetry(ts=4.0, free_blocks=2, total_blocks=48, block_size=32, running=2,
                        recomputed_tokens=0, kv_blocks_removed=0))
    offer(c, "q", t=4.0, tokens=32 * 10)
    return c, c.tick(4.0)


def test_the_slot_wait_is_not_read_from_the_short_roots_that_finish_first():
    # Three roots admitted at t=0: s (2 turns) finishes first, at t=10; l0 and l1 make 10 turns. A
    # root's active time is 5 s per turn (s's 10 s over its 2 turns) x 22/3 turns (the mean of the
    # three admitted) = 36.7 s, so the next slot is 18.3 s away with 2 active, not the 5 s that s's
    # own 10 s would give. q (11 blocks short of a spent budget, 4 turns) rebuilds 352 tokens a turn
    # at 2.5 ms per token and stalls 3 calls: 10.6 s, less than holding it.
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=2, window_max=8)
    c.set_cost_model(CostModel(prefill_s_per_token=2.5e-3, source="test"))
    c.observe(tel(0, free=48, total=48, bs=32))
    c.offer(PendingRoot("s", 0.0, 320, {"turns": 2}))
    for w in ("l0", "l1"):
        c.offer(PendingRoot(w, 0.0, 320, {"turns": 10}))
    assert c.tick(0.0) == ["s", "l0", "l1"]
    c.update_estimate("s", 352, 5.0)
    for k, t in ((1, 5.0), (2, 10.0)):
        for w in ("l0", "l1"):
            c.update_estimate(w, 320 + 32 * k, t)
    c.finish("s", 10.0, turns=2)
    c.observe(Telemetry(ts=10.0, free_blocks=2, total_blocks=48, block_size=32, running=2,
                        recomputed_tokens=0, kv_blocks_removed=0))
    c.offer(PendingRoot("q", 10.0, 320, {"turns": 4}))
    assert c.tick(10.0) == ["q"]
    ev = _admit_event(c, "q")
    assert ev["mode"] == "cost_overflow" and ev["expected_queue_s"] == pytest.approx(10 / 2 * 22 / 3 / 2)
    assert ev["expected_rebuild_s"] == pytest.approx(4 * 352 * 2.5e-3 * 3)


def test_a_root_that_the_next_slot_makes_fit_is_held_and_waits_for_it():
    # Rebuilds cost 0.64 s per turn per stalled call: more than the wait for the next slot, which
    # frees the budget q needs. q is held, however long it has waited already.
    c, held = _expensive_hold()
    assert held == []
    late = 4.0 + 100.0
    c.observe(Telemetry(ts=late, free_blocks=2, total_blocks=48, block_size=32, running=2,
                        recomputed_tokens=0, kv_blocks_removed=0))
    assert c.tick(late) == []


@pytest.mark.parametrize("waiting", [0, 3, None])
def test_a_root_is_not_held_for_a_slot_that_would_not_make_it_fit(waiting):
    # A 100-block pool (1600 tokens) that the two active roots already overflow at every coming
    # turn; b arrives with nothing free: its overflow now is its whole context at every turn plus its
    # footprint short of the budget, 84,480 tokens x 0.4 ms x 3 stalled calls = 101 s, above the 50 s
    # a slot is expected in. But the pool keeps none of the roots' contexts, and no slot makes b fit:
    # with both roots gone (100 s) b alone still overflows from its first turn on (36,000 tokens:
    # 43 s). Whatever waits in the engine, b goes in.
    admitted, c = _third_root(100, 0, 4e-4, waiting=waiting)
    assert admitted == ["b"]
    ev = _admit_event(c)
    assert ev["mode"] == "cost_overflow" and ev["wait_slots"] == 2
    assert ev["expected_rebuild_s"] == pytest.approx(3 * 4e-4 * 84_480, rel=0.01)
    # waiting for both roots (2 x 50 s) and then still rebuilding 36,000 tokens beats waiting for one
    assert ev["expected_queue_s"] == pytest.approx(100.0 + 3 * 4e-4 * 36_000, rel=0.01)


def test_where_the_pool_keeps_the_contexts_the_wait_is_the_next_slot():
    # The 1000-block pool (16,000 tokens) keeps window_min (1) of the grown contexts (mean 11,667):
    # b (17,000 tokens) overflows it even alone, its rebuilds (67 s at 0.1 ms per token) are above
    # the 50 s to a slot, and b is held (waiting for both roots, 100 s, would leave 9.6 s of
    # rebuilds: reading that wait here would let it in).
    assert _third_root(1000, 600, 1e-4, b_tokens=17_000, waiting=0)[0] == []


def test_keepable_is_read_from_the_contexts_the_roots_will_have():
    # A 4800-token pool holds window_min (1) of the current contexts (3400, 3400 and b's 3000: a
    # mean of 3267) but not of those they reach over their remaining 10 turns at 400 tokens a turn
    # (7400, 7400, 7000): the pool keeps none of them across a tool gap by the end of their lives,
    # the horizon the hold is decided on, so the wait is read from the projection and b goes in.
    admitted, c = _third_root(300, 0, 4e-4, waiting=0)
    assert admitted == ["b"] and c._turn_growth == pytest.approx(400.0)
    assert _admit_event(c)["wait_slots"] >= 1


def test_fit_wait_is_the_cheapest_of_waiting_for_each_group_of_ending_roots():
    # Three active roots ending after 3, 5 and 8 more turns; holding weighs waiting 1, 2 or 3 slots
    # (the rest grown by the turns that took, most turns left first as the projection needs: the
    # long root alone passes the pool, which the candidate's overflow must not be charged for) plus
    # the candidate's rebuilds then.
    from vllm_mars.costmodel import CostModel

    cost = CostModel(prefill_s_per_token=1e-3, source="test")
    items, cand, cap, g = [(8.0, 470.0), (5.0, 20.0), (3.0, 50.0)], (4.0, 300.0), 400.0, 10.0

    def rebuild(per_turn):
        return rebuild_cost_s(cost, 4.0, 0, 16, 0, per_turn)

    def then(k, later):
        grown = sorted([*later, cand], reverse=True)
        return k * 1.0 + rebuild(marginal_overflow(later, grown, cap, g))

    one = [(5.0, 500.0), (2.0, 50.0)]
    want = min(then(1, one), then(2, [(3.0, 520.0)]), then(3, []))
    got, k = fit_wait_s(rebuild, items, cand, cap, 1.0, g)
    assert got == pytest.approx(want) and 1 <= k <= 3
    assert then(1, one) != pytest.approx(then(1, one[::-1]))  # the order matters here


def test_shared_prefix_counts_once_in_the_projection():
    # Two active 10-turn roots of 3000 tokens in a 1200-block pool (19200 tokens), each grown by
    # 400; a1's first call found 2500 of its tokens cached (a prefix it shares with a0), so its own
    # context is 900 tokens: with b (3000 tokens, 10 turns) the lives peak at 18100 tokens and b fits
    # (counted whole, a1 would make the peak 9800 + 3 x 9 x 400 = 20600, past the pool).
    from vllm_mars.costmodel import CostModel

    c = mars(window_min=1, window_max=16)
    c.set_cost_model(CostModel(prefill_s_per_token=1e-3, source="test"))
    c.observe(tel(0, free=1200, total=1200))
    for i in range(2):
        c.offer(PendingRoot(f"a{i}", 0.0, 3000, {"turns": 10}))
    assert c.tick(0.0) == ["a0", "a1"]
    c.observe_cached("a0", 0)
    c.observe_cached("a1", 2500)
    c.observe_cached("a1", 3000)  # a later report is not its first call's: ignored
    for i in range(2):
        c.update_estimate(f"a{i}", 3400, 50.0)
    c.observe(Telemetry(ts=100.0, free_blocks=600, total_blocks=1200, block_size=16, running=2,
                        recomputed_tokens=0, kv_blocks_removed=0))
    c.offer(PendingRoot("b", 100.0, 3000, {"turns": 10}))
    assert c.tick(100.0) == ["b"]
    ev = _admit_event(c)
    assert ev["mode"] == "cost_fit" and ev["life_peak_tokens"] == 18100


def test_observe_cached_ignores_what_it_cannot_use():
    c = mars()
    c.observe(tel(0, free=1000, total=1000))
    c.offer(PendingRoot("a", 0.0, 100))
    assert c.tick(0.0) == ["a"]
    for bad in (-1, 2.5, "3", None, True):
        c.observe_cached("a", bad)
    c.observe_cached("nobody", 50)
    assert c._active["a"].shared is None
    c.observe_cached("a", 10_000)  # more than its context: it adds nothing of its own
    assert c._own_tokens(c._active["a"]) == 0.0
