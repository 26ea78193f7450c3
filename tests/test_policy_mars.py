"""The ``mars`` policy in the scheduler rig (real vLLM Scheduler, fake model outputs, virtual clock).

One test per mechanism. Each runs the scenario with the mechanism on and asserts the property, and
runs it again with only that mechanism switched off (its config field) and asserts the property is
lost, so every test fails when its mechanism is removed. Every run ends with assert_no_leaks.
"""

from __future__ import annotations

import logging

import pytest
from vllm.v1.request import RequestStatus
from vllm_mars.clock import VirtualClock
from vllm_mars.costmodel import CostModel
from vllm_mars.engine.rig import (
    assert_block_invariants,
    assert_no_leaks,
    fake_model_output,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)
from vllm_mars.policies import available_policies, make_policy
from vllm_mars.policies.mars import MarsConfig, MarsPolicy


def _sched(policy: str = "mars", clock: VirtualClock | None = None, **kw):
    options = kw.pop("options", None)
    return make_scheduler(policy, clock=clock or VirtualClock(), policy_options=options, **kw)


def _finish(s, clock: VirtualClock | None = None) -> None:
    """Run to completion, drop what is still retained, and check that nothing leaked."""
    run_to_completion(s)
    if clock is not None:
        clock.advance(10_000)
        s.schedule()  # releases expired retention
    s.release_retention()
    assert_no_leaks(s)


def _record_preemptions(s) -> list[tuple[int, str, int]]:
    """Wrap the real _preempt_request to log (step, request id, computed tokens) of each victim."""
    events: list[tuple[int, str, int]] = []
    original = s._preempt_request

    def preempt(request, timestamp, drop_stale_output=False):
        events.append((s._mars_test_step, request.request_id, request.num_computed_tokens))
        return original(request, timestamp, drop_stale_output)

    s._mars_test_step = 0
    s._preempt_request = preempt
    return events


# -- registry and config -------------------------------------------------------------------------
def test_mars_and_ablations_are_registered_with_their_switches():
    names = available_policies()
    for n in ("mars", "mars-no-mlfq", "mars-no-elastic", "mars-no-retention", "mars-no-cost-reclaim",
              "mars-no-value-retention", "mars-no-scaled-mlfq", "mars-no-prefill-reserve", "mars-no-evicted-order", "mars-no-priced-reserve"):
        assert n in names
    assert make_policy("mars-no-priced-reserve").config.reserve_priced is False
    assert make_policy("mars-no-evicted-order").config.evicted_order is False
    assert make_policy("mars-no-mlfq").config.mlfq is False
    assert make_policy("mars-no-elastic").config.elastic is False
    p = make_policy("mars-no-retention")
    assert p.config.retention is False and not p.retains
    full = make_policy("mars")
    assert full.retains and full.caps_chunks and full.tracks_service and full.custom_victims
    # A JSON list is accepted for tuples; bad values name the field and what is allowed.
    assert make_policy("mars", {"quanta": [8, 4, 2, 1]}).config.quanta == (8, 4, 2, 1)
    with pytest.raises(ValueError, match="level_thresholds.*increasing"):
        make_policy("mars", {"level_thresholds": [10, 5, 20]})
    with pytest.raises(ValueError, match="aging_s"):
        make_policy("mars", {"aging_s": -1})
    with pytest.raises(ValueError, match="valid keys"):
        make_policy("mars", {"agingg_s": 1})


def test_reload_cost_model_calibration():
    m = CostModel.fit_prefill([(100, 0.03), (1000, 0.21), (2000, 0.41)])
    assert m.prefill_s_per_token == pytest.approx(2e-4, rel=1e-6)
    assert m.step_overhead_s == pytest.approx(0.01, abs=1e-9)
    p = MarsPolicy(MarsConfig())
    assert not p.cost.calibrated  # the default says so
    p.calibrate_reload([(0, 0.0), (1000, 1.0)])
    assert p.cost.rebuild_s(500) == pytest.approx(0.5) and p.cost.calibrated and p.cost_pinned
    with pytest.raises(ValueError, match="samples"):
        CostModel.fit_prefill([(1, 1.0)])


# -- MLFQ ----------------------------------------------------------------------------------------
def _decode_vs_prefill(options: dict) -> list[dict[str, int]]:
    # B: a long prompt demoted to the bottom level during its prefill, now decoding.
    # A: a level-0 prefill arriving while B decodes; the step budget fits A's chunk alone.
    s = _sched(options=options, num_blocks=400, max_num_batched_tokens=256, max_num_seqs=8)
    s.add_request(make_request("B", prompt_len=3000, max_tokens=12))
    while s.requests["B"].num_computed_tokens < 3000:
        step(s)
    s.add_request(make_request("A", prompt_len=1500, max_tokens=2))
    steps = []
    while s.requests.get("A") is not None and s.requests["A"].num_computed_tokens < 1500:
        so, _ = step(s)
        steps.append(dict(so.num_scheduled_tokens))
        if "B" not in s.requests:
            break
    _finish(s)
    return steps


def test_running_decode_is_served_before_a_long_prefill():
    steps = _decode_vs_prefill({})
    assert steps and all(d.get("B") == 1 for d in steps[:10]), steps  # B decodes every step
    # Without decode promotion the demoted decode waits behind the new prefill.
    off = _decode_vs_prefill({"promote_decodes": False})
    assert any("B" not in d for d in off[:10]), off


def _short_vs_long(policy: str, options: dict | None = None) -> int:
    """Step at which a short turn arriving behind a long prefill is first scheduled."""
    s = _sched(policy, options=options, num_blocks=600, max_num_batched_tokens=2048)
    s.add_request(make_request("long", prompt_len=6000, max_tokens=2))
    first = None
    for i in range(10):
        if i == 1:
            s.add_request(make_request("short", prompt_len=200, max_tokens=2))
        so, _ = step(s)
        if first is None and "short" in so.num_scheduled_tokens:
            first = i
    _finish(s)
    return first


def test_short_new_turn_overtakes_a_long_one():
    assert _short_vs_long("mars") == 1  # scheduled in the step it arrives
    assert _short_vs_long("mars-no-mlfq") > 1  # the long prefill takes the whole budget first
    assert _short_vs_long("fcfs") > 1


def _late_turn_order(options: dict) -> list[str]:
    """Waiting order of a late turn (large prompt, mostly cached) vs an earlier mid-size prompt."""
    s = _sched(options=options, num_blocks=800, max_num_batched_tokens=8192)
    t0 = make_request("w-t0", prompt_len=4800, max_tokens=1, workflow="w", turn=0, last_step=False)
    s.add_request(t0)
    run_to_completion(s)
    s.release_retention()
    ids = list(t0.prompt_token_ids) + [42] + list(range(100, 300))
    s.add_request(make_request("other", prompt_len=3000, max_tokens=1))
    s.add_request(make_request("w-t1", prompt_token_ids=ids, max_tokens=1, workflow="w", turn=1,
                               last_step=True))
    so = s.schedule()
    order = [r.req_id for r in so.scheduled_new_reqs]
    s.update_from_output(so, fake_model_output(s, so))
    _finish(s)
    return order


def test_entry_level_ranks_a_late_turn_by_its_uncached_part():
    # 5001 prompt tokens, 4801 cached (its previous turn): level 0, ahead of a 3000-token level-1 call.
    assert _late_turn_order({})[0] == "w-t1"
    assert _late_turn_order({"estimate_cached_prefix": False})[0] == "other"


def _chunks(policy: str, options: dict | None = None) -> list[int]:
    s = _sched(policy, options=options, num_blocks=400, max_num_batched_tokens=2048)
    s.add_request(make_request("L", prompt_len=3000, max_tokens=1))
    sizes = []
    while s.has_requests():
        so, _ = step(s)
        sizes.append(so.num_scheduled_tokens.get("L", 0))
    _finish(s)
    return sizes


def test_demotion_after_a_spent_quantum():
    # Level 1 (3000 <= 8192): quantum 1024, then demoted to level 2 (512), then 3 (256).
    sizes = _chunks("mars", {"scaled_mlfq": False})
    assert sizes[:4] == [1024, 512, 256, 256], sizes
    assert sum(sizes) == 3000
    assert _chunks("mars-no-mlfq")[:2] == [2048, 952]


def _contended_chunks(options: dict) -> list[dict[str, int]]:
    s = _sched(options=options, num_blocks=700, max_num_batched_tokens=2048)
    s.add_request(make_request("L", prompt_len=3000, max_tokens=1))
    s.add_request(make_request("M", prompt_len=6000, max_tokens=1))  # competes for the step
    out = []
    while s.has_requests():
        so, _ = step(s)
        if so.num_scheduled_tokens:
            out.append(dict(so.num_scheduled_tokens))
    _finish(s)
    return out


def test_quanta_never_idle_the_step_budget():
    # Alone, a prefill takes the whole step budget (no idle tokens while it has work left) ...
    assert _chunks("mars")[:2] == [2048, 952]
    # ... and with fixed quanta it leaves most of the budget idle.
    assert _chunks("mars-no-scaled-mlfq")[:2] == [1024, 512]
    # Against competing work the quantum still binds: L gets its level's quantum first, and the
    # step budget is filled by the other prefill.
    steps = _contended_chunks({})
    assert steps[0]["L"] == 1024 and sum(steps[0].values()) == 2048, steps
    # Every step until the last one uses the whole budget.
    assert all(sum(d.values()) == 2048 for d in steps[:-1]), steps
    fixed = _contended_chunks({"scaled_mlfq": False})
    assert any(sum(d.values()) < 2048 for d in fixed[:-1]), fixed


def _chunks_beside_a_decode(options: dict) -> list[int]:
    """L's prefill chunks while another call decodes in every step."""
    s = _sched(options=options, num_blocks=700, max_num_batched_tokens=2048)
    s.add_request(make_request("D", prompt_len=64, max_tokens=400))
    step(s)  # D's prefill; from now on it decodes
    s.add_request(make_request("L", prompt_len=3000, max_tokens=1))
    sizes = []
    while s.has_requests():
        so, _ = step(s)
        if "L" in so.num_scheduled_tokens:
            assert so.num_scheduled_tokens.get("D") == 1  # D decodes beside it
            sizes.append(so.num_scheduled_tokens["L"])
    _finish(s)
    return sizes


def test_quanta_beside_running_decodes():
    # A decoding call rides in every step a prefill chunk lengthens: the chunk grows only to the
    # prefill tokens the step's fixed cost is worth (here 6 ms / 4 us = 1500 tokens: a GPU whose
    # weight read hides them), never below the quantum, not to the 2047 tokens the decode leaves ...
    cost = {"prefill_s_per_token": 4e-6, "call_overhead_s": 6e-3, "source": "test"}
    assert CostModel.from_dict(cost).free_prefill_tokens() == 1500
    sizes = _chunks_beside_a_decode({"cost_model": cost})
    assert sizes[:2] == [1500, 1500] and sum(sizes) == 3000, sizes
    cpu = dict(cost, call_overhead_s=1e-3)  # 250 tokens: below every quantum, the quanta bind
    assert _chunks_beside_a_decode({"cost_model": cpu})[:3] == [1024, 512, 256]
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['quanta_beside_decodes'\]"):
        make_policy("mars", {"quanta_beside_decodes": "budget"})  # retired (docs/history.md)


def _first_service_of_starved(aging_s: float, horizon_s: float, scaled: bool = False) -> float | None:
    """Virtual time at which a level-3 call is first scheduled under continuous short arrivals."""
    clock = VirtualClock()
    s = _sched(clock=clock, options={"level_thresholds": [16, 32, 64], "aging_s": aging_s, "scaled_mlfq": scaled},
               num_blocks=3000, max_num_batched_tokens=64, max_num_seqs=64)
    s.add_request(make_request("starved", prompt_len=200, max_tokens=2))
    first, i = None, 0
    while clock.now() <= horizon_s:
        for j in range(4):  # 4 x 16 prompt tokens a second: more than the 64-token budget
            s.add_request(make_request(f"s{i}-{j}", prompt_len=16, max_tokens=2))
        so, _ = step(s)
        if first is None and "starved" in so.num_scheduled_tokens:
            first = clock.now()
            break
        clock.advance(1.0)
        i += 1
    _finish(s, clock)
    return first


def test_aging_bounds_the_wait_of_a_bottom_level_call():
    aging = 10.0
    t = _first_service_of_starved(aging, horizon_s=60)
    assert t is not None and t <= 3 * aging + 1.0, t
    # Without aging it starves for the whole horizon.
    assert _first_service_of_starved(0.0, horizon_s=60) is None


def test_aging_scales_with_observed_turn_times():
    # Turns here take seconds; a fixed 30 s aging leaves the bottom-level call waiting > 60 s,
    # aging per four observed mean turn times serves it well within that.
    t = _first_service_of_starved(30.0, horizon_s=60, scaled=True)
    assert t is not None and t < 60, t
    assert _first_service_of_starved(30.0, horizon_s=60, scaled=False) is None


# -- elastic prefill -----------------------------------------------------------------------------
def _elastic_scenario(policy: str) -> tuple[int, list[int]]:
    """Four decoders cross a block boundary while B prefills: B's chunk has half the blocks it needs."""
    s = _sched(policy, num_blocks=25, max_num_batched_tokens=128, max_num_seqs=16)
    for i in range(4):
        s.add_request(make_request(f"d{i}", prompt_len=31, max_tokens=3))
    step(s)
    s.add_request(make_request("B", prompt_len=250, max_tokens=2))
    preempted, chunks = 0, []
    while s.has_requests():
        so, _ = step(s)
        preempted += len(so.preempted_req_ids or ())
        chunks.append(so.num_scheduled_tokens.get("B", 0))
        assert_block_invariants(s)
    _finish(s)
    return preempted, chunks


def test_elastic_prefill_shrinks_the_chunk_instead_of_preempting():
    preempted, chunks = _elastic_scenario("mars")
    assert preempted == 0
    assert chunks[0] == 124 and 0 < chunks[1] < 124, chunks  # shrunk to the free blocks
    assert _elastic_scenario("mars-no-elastic")[0] >= 1
    assert _elastic_scenario("fcfs")[0] >= 1


# -- priority-aware reclamation -----------------------------------------------------------------
def _reclaim_scenario(options: dict, policy: str = "mars") -> list[tuple[int, str, int]]:
    options = {"level_thresholds": [16, 32, 48], "scaled_mlfq": False, "reserve_prefills": False, **options}
    s = _sched(policy, options=options, num_blocks=200, max_num_batched_tokens=512, max_num_seqs=16)
    events = _record_preemptions(s)
    for i in range(4):
        s.add_request(make_request(f"d{i}", prompt_len=31, max_tokens=200))
    s.add_request(make_request("Pa", prompt_len=2000, max_tokens=2))
    k = 0
    while s.has_requests():
        if k == 2:
            s.add_request(make_request("Pb", prompt_len=2000, max_tokens=2))
        s._mars_test_step = k
        step(s)
        assert_block_invariants(s)
        k += 1
    _finish(s)
    return events


def test_reclamation_order_and_early_stop():
    # Two level-3 prefills and four decodes; the pool runs out once. SPEC's rule (cost_reclaim off)
    # takes the prefill holding the most KV (Pa, started first), spares decodes, stops after one.
    events = _reclaim_scenario({"cost_reclaim": False})
    assert [e[1] for e in events] == ["Pa"], events
    # Without priority reclamation vLLM takes the last of the running order: the smaller Pb.
    assert [e[1] for e in _reclaim_scenario({"priority_reclaim": False})] == ["Pb"]


def _decoders_vs_late_arrival(policy: str, options: dict | None = None) -> list[tuple[str, int]]:
    """Three short decoders and a later 300-token call all grow until the 47-block pool runs out."""
    s = _sched(policy, options=options, num_blocks=48, max_num_batched_tokens=512, max_num_seqs=16)
    events = _record_preemptions(s)
    for i in range(3):
        s.add_request(make_request(f"d{i}", prompt_len=31, max_tokens=160))
    step(s)
    s.add_request(make_request("L", prompt_len=300, max_tokens=160))
    while s.has_requests():
        step(s)
        assert_block_invariants(s)
    _finish(s)
    return [(e[1], e[2]) for e in events]


def test_cost_reclaim_never_recomputes_more_than_fcfs():
    # fcfs preempts the latest arrival (L, 380 tokens computed); the cost rule preempts the calls
    # cheapest to rebuild (the short decoders), recomputing fewer tokens for the blocks it needs.
    recomputed = {}
    for name, policy, options in (("fcfs", "fcfs", None), ("mars", "mars", {}),
                                  ("no-cost", "mars-no-cost-reclaim", {})):
        victims = _decoders_vs_late_arrival(policy, options)
        assert victims, name
        recomputed[name] = sum(n for _, n in victims)
    assert recomputed["mars"] < recomputed["fcfs"], recomputed
    # Off, the largest-KV rule throws away L's context like fcfs does.
    assert recomputed["no-cost"] > recomputed["mars"], recomputed


def _late_short_calls(policy: str, options: dict | None = None, evicted: bool = False) -> list[tuple[str, int]]:
    """A long prefill (demoted to the bottom level) while short calls keep arriving: does anyone
    get preempted when the long prefill needs its remaining blocks? ``evicted``: first, workflows
    whose returning turns find none of their context (``_evict_contexts``)."""
    s = _sched(policy, options=options, num_blocks=200, max_num_batched_tokens=512, max_num_seqs=16)
    if evicted:
        _evict_contexts(s)
        assert s.mars_policy._evicted, "the prelude must leave the pool seen as not keeping contexts"
    events = _record_preemptions(s)
    s.add_request(make_request("long", prompt_len=2400, max_tokens=2))
    k = 0
    while s.has_requests():
        if k in (2, 3, 4, 5):
            s.add_request(make_request(f"s{k}", prompt_len=300, max_tokens=60))
        step(s)
        assert_block_invariants(s)
        k += 1
    _finish(s)
    return [(e[1], e[2]) for e in events]


def test_admission_reserves_the_running_prefills_kv():
    # vLLM admits a short call when its own prompt fits; MLFQ then serves it before the demoted long
    # prefill, which later finds its blocks taken: a preemption fcfs never makes. Reserving the
    # running prefills' remaining KV at admission keeps mars at fcfs's zero.
    options = {"level_thresholds": [512, 1024, 2048]}
    assert _late_short_calls("fcfs") == []
    assert _late_short_calls("mars", options) == []
    assert _late_short_calls("mars-no-prefill-reserve", options), "the scenario must preempt without it"


def _reserve_gate(options: dict, evicted: bool) -> bool:
    """Whether a short waiting call may start while a long prefill is one chunk in, the free blocks
    holding the long one's remaining KV but not both (``evicted``: after ``_evict_contexts``)."""
    s = _sched("mars", options={"level_thresholds": [512, 1024, 2048], "retention": False, **options},
               num_blocks=200, max_num_batched_tokens=512, max_num_seqs=16)
    if evicted:
        _evict_contexts(s)
    assert s.mars_policy._evicted is evicted
    s.add_request(make_request("long", prompt_len=2400, max_tokens=2))
    for _ in range(20):
        if s.call("long").remaining_prefill < 2400 - 200:
            break
        step(s)
    s.add_request(make_request("short", prompt_len=1000, max_tokens=2))
    bs = s.block_size
    need = -(-s.call("long").remaining_prefill // bs) + -(-1000 // bs)
    assert s.call("long").remaining_prefill > 0 and need > s.free_blocks(), (need, s.free_blocks())
    may = s.mars_policy.may_start(s.call("short"))
    _finish(s)
    return may


def test_prefill_reserve_holds_also_where_the_pool_cannot_keep_contexts():
    # The reserve holds the short call whether or not the evicted-order EMA says returning turns
    # find their contexts gone (without the reserve the scheduler does not ask: the gate is off).
    assert _reserve_gate({}, evicted=False) is False
    assert _reserve_gate({}, evicted=True) is False
    assert make_policy("mars").gates is True and make_policy("mars", {"reserve_prefills": False}).gates is False


def _held_shorts(options: dict) -> tuple[dict, int]:
    """Three long prefills in turn, four short calls arriving during each while the clock moves 1 s
    per step: the reserve holds the shorts for seconds. (The policy's state, preemptions.)"""
    clock = VirtualClock()
    s = _sched("mars", clock=clock, options={"level_thresholds": [512, 1024, 2048], "retention": False, **options},
               num_blocks=200, max_num_batched_tokens=512, max_num_seqs=16)
    events = _record_preemptions(s)
    k = 0
    for j in range(3):
        s.add_request(make_request(f"long{j}", prompt_len=2400, max_tokens=2))
        k0 = k
        while s.has_requests():
            if k - k0 in (2, 3, 4, 5):
                s.add_request(make_request(f"s{k}", prompt_len=300, max_tokens=60))
            step(s)
            assert_block_invariants(s)
            clock.advance(1.0)
            k += 1
    state = s.mars_policy.state()
    assert not s.mars_policy._priced_running
    _finish(s, clock)
    return state, len(events)


def test_priced_reserve_starts_held_calls_when_holding_costs_more():
    # Holds last seconds here while a preemption's rebuild costs milliseconds (the default cost
    # model): once two holds are seen, the priced reserve starts the calls it would hold, and counts
    # the preemptions that follows. Off (the default), it holds every one and preempts nobody.
    state, preemptions = _held_shorts({"reserve_priced": False})
    assert preemptions == 0 and "reserve_priced_starts" not in state
    state, preemptions = _held_shorts({"reserve_priced": True, "reserve_min_holds": 2})
    assert state["reserve_hold_median_s"] >= 1.0, state
    assert state["reserve_priced_starts"] > 0, state
    assert state["reserve_priced_preemptions"] == preemptions > 0, (state, preemptions)
    assert make_policy("mars").config.reserve_priced is True  # the default
    with pytest.raises(ValueError, match="'reserve_min_holds' must be an integer >= 1"):
        make_policy("mars", {"reserve_min_holds": 0})


def test_priced_reserve_holds_when_starts_have_preempted():
    # The same gate as _reserve_gate's, with the learned figures set: long holds and a cheap
    # rebuild start the call; once every priced start has preempted someone and a preemption took
    # far longer to recover from than a hold lasts, it holds again.
    def gate(preempted: int, recovery_s: float | None) -> bool:
        s = _sched("mars", options={"level_thresholds": [512, 1024, 2048], "retention": False,
                                    "reserve_priced": True}, num_blocks=200, max_num_batched_tokens=512)
        p = s.mars_policy
        p._holds.extend([5.0] * 8)
        p._priced_starts = p._priced_preemptions = preempted
        if recovery_s is not None:
            p._recoveries.extend([recovery_s] * 3)
        s.add_request(make_request("long", prompt_len=2400, max_tokens=2))
        for _ in range(3):
            step(s)
        s.add_request(make_request("short", prompt_len=1000, max_tokens=2))
        need = -(-s.call("long").remaining_prefill // s.block_size) + -(-1000 // s.block_size)
        assert need > s.free_blocks(), (need, s.free_blocks())
        may = p.may_start(s.call("short"))
        _finish(s)
        return may

    assert gate(0, None) is True
    assert gate(0, 2.0) is True
    assert gate(20, 60.0) is False
    assert gate(20, 2.0) is True   # preempting is certain but costs less than a hold


# -- retention -----------------------------------------------------------------------------------
def _retention_scenario(policy: str, clock: VirtualClock):
    """W's turn 0 ends in a tool call; other traffic then needs most of the pool; W returns at 1 s."""
    s = _sched(policy, clock=clock, num_blocks=65, max_num_batched_tokens=1024)
    w0 = make_request("w-0", prompt_len=320, max_tokens=1, workflow="w", turn=0, last_step=False)
    s.add_request(w0)
    run_to_completion(s)
    retained = s.mars_stats()["retained_blocks"]
    clock.advance(0.2)
    s.add_request(make_request("g", prompt_len=320, max_tokens=1))
    run_to_completion(s)
    clock.advance(0.2)
    s.add_request(make_request("f", prompt_len=640, max_tokens=1))
    run_to_completion(s)
    clock.advance(0.6)
    ids = list(w0.prompt_token_ids) + [42] + list(range(500, 550))
    w1 = make_request("w-1", prompt_token_ids=ids, max_tokens=2, workflow="w", turn=1, last_step=True)
    s.add_request(w1)
    step(s)
    cached = s.call("w-1").num_cached_tokens
    run_to_completion(s)
    stats = s.mars_stats()
    _finish(s, clock)
    return retained, cached, stats


def test_retention_gives_a_returning_turn_its_prefix():
    retained, cached, stats = _retention_scenario("mars", VirtualClock())
    assert retained == 20
    assert cached >= 320, cached
    assert stats["retention"]["released_on_return"] == 1
    assert stats["retained_blocks"] == 0
    # Without retention the other traffic evicted the prefix.
    retained, cached, _ = _retention_scenario("mars-no-retention", VirtualClock())
    assert retained == 0 and cached < 320, cached


def _retain_one(clock: VirtualClock, **kw):
    s = _sched(clock=clock, num_blocks=kw.pop("num_blocks", 65), max_num_batched_tokens=1024, **kw)
    s.add_request(make_request("w-0", prompt_len=320, max_tokens=1, workflow="w", turn=0, last_step=False))
    run_to_completion(s)
    return s


def test_retention_is_released_on_expiry():
    clock = VirtualClock()
    s = _retain_one(clock)
    entry = s.retention.get("w")
    assert entry is not None and s.free_blocks() == s.num_blocks - 20
    assert entry.expires - clock.now() == pytest.approx(2.0 * 1.05 + 1e-3)  # cold start tau
    clock.advance(1.0)
    s.schedule()
    assert "w" in s.retention
    clock.advance(1.2)
    s.schedule()
    assert "w" not in s.retention and s.free_blocks() == s.num_blocks
    assert s.mars_stats()["retention"]["released_on_expiry"] == 1
    assert_no_leaks(s)


def test_retention_is_released_on_abort():
    clock = VirtualClock()
    s = _retain_one(clock)
    s.add_request(make_request("w-1", prompt_len=400, max_tokens=4, workflow="w", turn=1))
    s.finish_requests("w-1", RequestStatus.FINISHED_ABORTED)
    assert "w" not in s.retention and s.mars_stats()["retention"]["released_on_abort"] == 1
    assert_no_leaks(s)


def test_retention_goes_first_under_pressure_and_not_when_scarce():
    clock = VirtualClock()
    # (without the prefill reserve, which keeps a new call waiting while retained KV is held)
    s = _sched(clock=clock, num_blocks=65, max_num_batched_tokens=2048,
               options={"cost_model": {"prefill_s_per_token": 2e-3, "source": "test"},  # both worth keeping
                        "reserve_prefills": False})
    events = _record_preemptions(s)
    s.add_request(make_request("a-0", prompt_len=160, max_tokens=1, workflow="a", last_step=False))
    s.add_request(make_request("b-0", prompt_len=320, max_tokens=1, workflow="b", last_step=False))
    run_to_completion(s)
    assert {e.workflow for e in s.retention.entries()} == {"a", "b"}
    values = {e.workflow: e.value for e in s.retention.entries()}
    low = min(values, key=values.get)
    # A running decode holds 2 blocks; a new call needs more than the free blocks: the lowest-value
    # retention is released, the other kept, nobody preempted.
    s.add_request(make_request("d", prompt_len=20, max_tokens=30))
    step(s)
    free = s.free_blocks()
    s.add_request(make_request("big", prompt_len=(free + 5) * 16, max_tokens=2))
    step(s)
    assert "big" in {r.request_id for r in s.running} and low not in s.retention and len(s.retention) == 1, values
    assert s.mars_stats()["retention"]["released_under_pressure"] == 1 and not events
    # With free blocks scarce, a finishing turn is not retained.
    s.release_retention()
    s.add_request(make_request("c-0", prompt_len=16, max_tokens=1, workflow="c", last_step=False))
    s.add_request(make_request("hog", prompt_len=(s.free_blocks() - 3) * 16, max_tokens=40))
    step(s)
    step(s)
    assert "c-0" not in s.requests and "c" not in s.retention
    _finish(s, clock)


def _returning_prefix_under_pressure(policy: str) -> int:
    """W's turn ends with under 10 % of the pool free; a finished workflow's context is freed after
    it; a new call then needs 12 blocks. How much of W's context does its next turn find cached?"""
    clock = VirtualClock()
    s = _sched(policy, clock=clock, num_blocks=65, max_num_batched_tokens=2048,
               options={"cost_model": {"prefill_s_per_token": 2e-3, "source": "test"}, "reserve_prefills": False})
    s.add_request(make_request("hog", prompt_len=480, max_tokens=60))
    w0 = make_request("w-0", prompt_len=320, max_tokens=1, workflow="w", turn=0, last_step=False)
    s.add_request(w0)
    s.add_request(make_request("d-0", prompt_len=160, max_tokens=2, workflow="d", turn=0, last_step=True))
    for _ in range(3):
        step(s)
        clock.advance(0.05)
    s.add_request(make_request("n", prompt_len=192, max_tokens=1))
    for _ in range(2):
        step(s)
        clock.advance(0.05)
    ids = list(w0.prompt_token_ids) + [42] + list(range(500, 520))
    s.add_request(make_request("w-1", prompt_token_ids=ids, max_tokens=2, workflow="w", turn=1, last_step=True))
    step(s)
    cached = s.call("w-1").num_cached_tokens
    _finish(s, clock)
    return cached


def test_value_retention_pays_under_pressure():
    # Value rule: the rebuild saving beats the memory cost, so W is kept although free blocks are
    # scarce; the new call takes the finished workflow's dead cache instead of W's context.
    assert _returning_prefix_under_pressure("mars") >= 320
    # The free-share cut-off refuses below 10 % free: LRU evicts W's tail before the dead cache.
    assert _returning_prefix_under_pressure("mars-no-value-retention") < 320


def test_retention_tau_is_learned_from_return_gaps():
    clock = VirtualClock()
    s = _sched(clock=clock, num_blocks=200, max_num_batched_tokens=2048)
    ids: list[int] = list(range(10, 170))
    for turn in range(5):
        ids = ids + [42] + list(range(1000 + 50 * turn, 1050 + 50 * turn))
        s.add_request(make_request(f"w-{turn}", prompt_token_ids=ids, max_tokens=1, workflow="w",
                                   turn=turn, tool="bash", last_step=False))
        run_to_completion(s)
        clock.advance(0.5 if turn % 2 else 0.7)  # observed gaps 0.7, 0.5, 0.7, 0.5
    entry = s.retention.get("w")
    assert entry is not None
    # The tau with the best expected saving covers every observed gap (0.7 s), not the 2 s cold start.
    tau = entry.expires - entry.since
    assert tau == pytest.approx(0.7 * 1.05 + 1e-3), tau
    # Gaps longer than max_retention_s are not worth holding for.
    s2 = _sched(clock=clock, options={"max_retention_s": 0.3}, num_blocks=200)
    for turn in range(5):
        s2.add_request(make_request(f"v-{turn}", prompt_len=100 + turn, max_tokens=1, workflow="v",
                                    turn=turn, last_step=False))
        run_to_completion(s2)
        if turn < 4:
            clock.advance(0.5)
    assert "v" not in s2.retention
    _finish(s, clock)
    _finish(s2, clock)


def test_a_preempted_call_remembers_its_likely_cached_prefix():
    # The reclamation scenario preempts Pa with 1792 of 2000 tokens computed: its blocks went to the
    # prefix cache, so its entry level is estimated from the ~208 tokens it probably has to redo.
    s = _sched(options={"level_thresholds": [16, 32, 48], "cost_reclaim": False, "scaled_mlfq": False,
                        "reserve_prefills": False},
               num_blocks=200,
               max_num_batched_tokens=512, max_num_seqs=16)
    seen: dict[str, tuple[int, int]] = {}
    original = s._preempt_request

    def preempt(request, timestamp, drop_stale_output=False):
        computed = request.num_computed_tokens
        original(request, timestamp, drop_stale_output)
        seen[request.request_id] = (computed, s.call(request.request_id).state.known_prefix)

    s._preempt_request = preempt
    for i in range(4):
        s.add_request(make_request(f"d{i}", prompt_len=31, max_tokens=200))
    s.add_request(make_request("Pa", prompt_len=2000, max_tokens=2))
    k = 0
    while s.has_requests():
        if k == 2:
            s.add_request(make_request("Pb", prompt_len=2000, max_tokens=2))
        step(s)
        k += 1
    _finish(s)
    assert seen == {"Pa": (1792, 1792)}, seen


def _preempted_vs_older(options: dict) -> tuple[list[str], list[str]]:
    """P (level 2) starts before the older X (level 3), spends its quanta down to level 3 and is
    preempted when decoding A needs a block; then P and X wait at the same level for one slot."""
    s = _sched(options={"level_thresholds": [256, 512, 1024], "quanta": [32, 32, 32, 32],
                        "elastic": False, "cost_reclaim": False, "scaled_mlfq": False, "reserve_prefills": False,
                        **options},
               num_blocks=90, max_num_batched_tokens=512, max_num_seqs=2)
    s.add_request(make_request("A", prompt_len=500, max_tokens=100))
    s.add_request(make_request("X", prompt_len=1100, max_tokens=2))
    s.add_request(make_request("P", prompt_len=900, max_tokens=2))
    started, preempted = [], []
    while s.has_requests():
        so, _ = step(s)
        preempted += list(so.preempted_req_ids or ())
        started += [r.req_id for r in so.scheduled_new_reqs]
        started += sorted(so.scheduled_cached_reqs.resumed_req_ids)  # resumed after preemption
    _finish(s)
    return preempted, started


def test_preempted_call_goes_first_within_its_level():
    preempted, started = _preempted_vs_older({})
    assert preempted == ["P"] and started == ["A", "P", "P", "X"], (preempted, started)
    # Without the rule the older X (same level) goes ahead of the preempted P.
    assert _preempted_vs_older({"preempted_first": False})[1] == ["A", "P", "X", "P"]


def test_prefill_reserve_gate_does_not_sort_the_waiting_queue_while_running_is_full():
    """The gate answers vLLM's "is the waiting queue empty?" by asking the policy about the head,
    which sorts the queue; with every running slot taken vLLM stops right after, so the gate must
    not sort (1000 waiting calls re-sorted every step made a scheduling cycle 1.6x stock's)."""
    s = _sched(max_num_seqs=4, num_blocks=2000)
    for i in range(4):
        s.add_request(make_request(f"run{i}", prompt_len=64, max_tokens=40, workflow=f"w{i}", turn=0))
    for _ in range(3):
        step(s)
    assert len(s.running) == 4
    for j in range(50):
        s.add_request(make_request(f"wait{j}", prompt_len=64, max_tokens=4, workflow=f"v{j}", turn=0))
    policy = s.mars_policy
    calls = {"n": 0}
    real = policy.waiting_key

    def counting(call):
        calls["n"] += 1
        return real(call)

    policy.waiting_key = counting
    for _ in range(5):  # running stays full: the 4 decoders have tokens left
        step(s)
    assert len(s.running) == 4 and calls["n"] == 0, calls
    policy.waiting_key = real
    _finish(s)


def _turn_after_newer_root(options: dict) -> list[str]:
    """Workflow A's first turn runs alone (one sequence slot) while workflow B's first call arrives;
    A's second turn arrives as A's first finishes. Both wait at level 0, B's call the older."""
    clock = VirtualClock()
    s = _sched(clock=clock, options={"retention": False, **options}, num_blocks=200, max_num_seqs=1)
    return ["A0"] + _a_turn_behind_b(s, clock, make_request("A1", prompt_len=96, max_tokens=3, workflow="A",
                                                           turn=1, last_step=True))


def _a_turn_behind_b(s, clock: VirtualClock, a1) -> list[str]:
    """Workflow A's first turn runs (one sequence slot), workflow B's first call arrives, then A's
    second turn ``a1`` as A's first finishes. The calls started after A's first, in order; ends
    with the leak check."""
    s.add_request(make_request("A0", prompt_len=64, max_tokens=3, workflow="A", turn=0, last_step=False))
    step(s)
    clock.advance(0.01)
    s.add_request(make_request("B0", prompt_len=64, max_tokens=3, workflow="B", turn=0, last_step=True))
    while "A0" in s.requests:
        step(s)
    s.add_request(a1)
    started = []
    while s.has_requests():
        so, _ = step(s)
        started += [r.req_id for r in so.scheduled_new_reqs]
    _finish(s, clock)
    return started


def test_ties_go_by_the_calls_own_arrival():
    # The newer workflow's first call arrived before the older workflow's second turn: it goes first.
    assert _turn_after_newer_root({}) == ["A0", "B0", "A1"]


def _order_after_evictions(options: dict, kept: bool = False) -> tuple[bool, list[str]]:
    """Eight workflows whose second turns find nothing of their first turn's context cached (fresh
    token ids: as if the pool had evicted it), then: workflow A's first turn, workflow B's first
    call (short: MLFQ level 0), A's second turn (3000 uncached tokens: level 1). One sequence slot."""
    clock = VirtualClock()
    s = _sched(clock=clock, options={"retention": False, **options}, num_blocks=400, max_num_seqs=1)
    _evict_contexts(s, kept)
    evicted = s.mars_policy._evicted
    return evicted, _a_turn_behind_b(s, clock, make_request("A1", prompt_len=3000, max_tokens=3, workflow="A",
                                                            turn=1, last_step=True, seed=77))


def _evict_contexts(s, kept: bool = False) -> None:
    """Eight workflows whose second turns find nothing of their first turn's context cached (fresh
    token ids: as if the pool had evicted it; ``kept``: the second turn extends the first)."""
    for i in range(8):
        first = [(i * 577 + j * 31) % 4000 + 3 for j in range(64)]
        s.add_request(make_request(f"w{i}-0", prompt_token_ids=first, max_tokens=2, workflow=f"w{i}",
                                   turn=0, last_step=False))
        run_to_completion(s)
        # kept: the second turn extends the first (its context is still cached); else fresh ids.
        second = (first + [42, 42] if kept else [(i * 911 + j * 17) % 4000 + 3 for j in range(66)])
        s.add_request(make_request(f"w{i}-1", prompt_token_ids=second + [7] * 30, max_tokens=2,
                                   workflow=f"w{i}", turn=1, last_step=True))
        run_to_completion(s)


def test_evicted_order_logs_when_it_switches(caplog):
    with caplog.at_level(logging.INFO, logger="vllm_mars.policies.mars"):
        assert _order_after_evictions({"evicted_order": True})[0] is True
    msgs = [r.getMessage() for r in caplog.records if r.name == "vllm_mars.policies.mars"]
    assert any("the pool cannot keep contexts" in m for m in msgs), msgs
    # the same reading is in the scheduler's stats
    s = _sched(options={"retention": False}, num_blocks=400, max_num_seqs=1)
    assert s.mars_stats()["policy_state"] == {"kept_share_ema": 1.0, "returning_turns": 0, "evicted": False,
                                             "reserve_hold_median_s": None, "reserve_recovery_median_s": None,
                                             "reserve_priced_starts": 0, "reserve_priced_preemptions": 0}
    _evict_contexts(s)
    st = s.mars_stats()["policy_state"]
    assert st["evicted"] is True and st["kept_share_ema"] < 0.5 and st["returning_turns"] == 8, st
    _finish(s)
    f = _sched("fcfs")
    assert f.mars_stats()["policy_state"] == {}
    _finish(f)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm_mars.policies.mars"):
        _order_after_evictions({"evicted_order": True}, kept=True)
    assert not [r for r in caplog.records if r.name == "vllm_mars.policies.mars"]


def test_evicted_order_finishes_earlier_workflows_when_contexts_are_not_kept():
    # The returning turns found none of their context: the earlier workflow's long turn goes first.
    assert _order_after_evictions({"evicted_order": True}) == (True, ["A1", "B0"])
    # Off: the MLFQ ranks A's turn by its 3000 uncached tokens (level 1) behind B's short call.
    assert _order_after_evictions({"evicted_order": False}) == (False, ["B0", "A1"])
    # Contexts kept (the second turns hit their first turn's prefix): the MLFQ order stays.
    assert _order_after_evictions({"evicted_order": True}, kept=True) == (False, ["B0", "A1"])
    with pytest.raises(ValueError, match="evicted_share"):
        make_policy("mars", {"evicted_share": 1.5})
    with pytest.raises(ValueError, match="evicted_ema_weight"):
        make_policy("mars", {"evicted_ema_weight": 0})


def test_evicted_order_switches_below_its_threshold():
    # Eight returns that found nothing leave the EMA at 1/9 = 0.11: below a threshold of 0.15 ...
    assert _order_after_evictions({"evicted_share": 0.15}) == (True, ["A1", "B0"])
    # ... not below one of 0.1.
    assert _order_after_evictions({"evicted_share": 0.1}) == (False, ["B0", "A1"])


def test_evicted_warmup_sees_a_pool_that_cannot_keep_contexts_after_a_few_returns():
    slow = {"evicted_order": True, "evicted_ema_weight": 0.03}
    # Eight returns that found nothing: the slow EMA alone is still at 0.97^8 = 0.78 ...
    assert _order_after_evictions({**slow, "evicted_warmup": False}) == (False, ["B0", "A1"])
    # ... the default (this, started as a running mean) is at 1/9:
    assert _order_after_evictions({}) == (True, ["A1", "B0"])
    # ... started as a running mean it is at 1/9, and the earlier workflow's turn goes first.
    assert _order_after_evictions({**slow, "evicted_warmup": True}) == (True, ["A1", "B0"])
    # Contexts kept: it stays off.
    assert _order_after_evictions({**slow, "evicted_warmup": True}, kept=True) == (False, ["B0", "A1"])
    with pytest.raises(ValueError, match="evicted_warmup must be bool"):
        make_policy("mars", {"evicted_warmup": 1})
