"""Issue 11, engine side: no client value raises out of the scheduler (defect 1), the scheduler log
is bounded and closed (defect 10), and PolicyQueue is a full RequestQueue under every policy, through
vLLM's reset / pause / sleep paths, retention included (defect 11).

All on the real vLLM Scheduler (``engine.rig``), every scenario ending with ``assert_no_leaks``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.exceptions import VLLMValidationError
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.request import RequestStatus
from vllm_mars.clock import VirtualClock
from vllm_mars.engine.rig import (
    assert_block_invariants,
    assert_no_leaks,
    fake_model_output,
    make_request,
    make_scheduler,
    step,
)
from vllm_mars.policies import available_policies
from vllm_mars.workflow import (
    MAX_ID_CHARS,
    MAX_TAG_INT,
    WORKFLOW_KEYS,
    WorkflowInfo,
    workflow_from_extra_args,
)

# infercept_swap refuses the CPU platform the rig runs on (by design).
POLICIES = [p for p in available_policies() if p != "infercept_swap"]
RETAINING = ["mars", "continuum"]  # retain in this scenario (infercept decides by its gap model)

# -- every JSON value kind, plus what Python's json module really produces from hostile input:
#    1e400 -> inf, 2**1024 as an int, NaN/Infinity literals, lone surrogates ("\ud800"), deep nesting.
_hostile = st.sampled_from([1e400, -1e400, math.nan, 1e300, 1.5, -1, 2**53, 2**53 + 1, 2**63, 2**1024, -2**1024,
                            10**4000, "\ud800", "1e400", "Infinity", "NaN", " 3 ", "３", "²", "0x10", "x" * 10_000,
                            "", True, None, [], {}])
_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                     st.text())
json_values = st.one_of(_hostile, _scalars, st.recursive(
    _scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                      st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=8))
extra_args = st.dictionaries(st.sampled_from([*WORKFLOW_KEYS, "other", "mars_x"]), json_values, max_size=8)


@settings(max_examples=400, deadline=None)
@given(extra_args)
def test_tag_parser_raises_only_value_error_and_bounds_what_it_accepts(xargs):
    try:
        info = workflow_from_extra_args(xargs, "req-1")
    except ValueError:
        return
    assert isinstance(info, WorkflowInfo) and info.workflow and info.root
    assert isinstance(info.turn, int) and 0 <= info.turn <= MAX_TAG_INT
    assert info.prefill_tokens is None or 0 <= info.prefill_tokens <= MAX_TAG_INT
    float(info.turn)  # policies do float arithmetic on tags: never an OverflowError
    assert isinstance(info.last_step, bool)
    assert all(v is None or 0 < len(v) <= MAX_ID_CHARS
               for v in (info.workflow, info.root, info.parent, info.tool, info.next_tool))


@pytest.mark.parametrize("value", [1e400, -1e400, math.inf, math.nan, 2**1024, "1e400", 1.5, -1, [1], {"a": 1}])
@pytest.mark.parametrize("key", ["mars_turn", "mars_prefill_tokens"])
def test_the_issue_values_are_value_errors(key, value):
    with pytest.raises(ValueError, match=key):
        workflow_from_extra_args({"mars_workflow": "w", key: value}, "r")


def test_well_formed_tags_still_parse():
    info = workflow_from_extra_args({"mars_workflow": "w", "mars_turn": "3", "mars_prefill_tokens": 7.0,
                                     "mars_last_step": "yes", "mars_root": 5}, "r")
    assert (info.workflow, info.root, info.turn, info.prefill_tokens, info.last_step) == ("w", "5", 3, 7, True)


@pytest.mark.parametrize("policy", POLICIES)
def test_no_client_tag_raises_out_of_add_request_or_schedule(policy):
    """Fuzz the real scheduler of every policy: each call is served (tagged or not) and nothing leaks."""
    clock = VirtualClock()
    s = make_scheduler(policy, num_blocks=64, block_size=16, clock=clock)
    ids = itertools.count()

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(extra_args, min_size=1, max_size=3))
    def serve(batch):
        reqs = []
        for xargs in batch:
            try:
                r = make_request(f"r{next(ids)}", prompt_len=40, max_tokens=2, extra_args=xargs or None)
            except VLLMValidationError:  # vLLM's own 400 (ints beyond 64 bits): never reaches us
                continue
            s.add_request(r)
            reqs.append(r)
        _steps(s, clock, 50)
        assert all(r.is_finished() for r in reqs)

    serve()
    clock.advance(10_000)
    s.schedule()
    s.release_retention()
    assert_no_leaks(s)


def test_bad_tag_is_logged_once_per_workflow_and_served_untagged(caplog):
    s = make_scheduler("mars", num_blocks=64, block_size=16, clock=VirtualClock())
    with caplog.at_level(logging.WARNING, logger="vllm_mars.engine.scheduler"):
        for i in range(3):
            s.add_request(make_request(f"bad{i}", prompt_len=20, max_tokens=1,
                                       extra_args={"mars_workflow": "w", "mars_turn": math.inf}))
        s.add_request(make_request("other", prompt_len=20, max_tokens=1,
                                   extra_args={"mars_workflow": "v", "mars_prefill_tokens": -1e400}))
    warnings = [r for r in caplog.records if "untagged" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]
    assert s.call("bad1").workflow == WorkflowInfo("bad1", "bad1", last_step=True, tagged=False)
    while s.has_requests():
        step(s)
    assert_no_leaks(s)


def test_sched_log_caps_ids_writes_hostile_values_and_closes(tmp_path, monkeypatch):
    path = tmp_path / "sched.jsonl"
    monkeypatch.setenv("MARS_SCHED_LOG", str(path))
    s = make_scheduler("fcfs", num_blocks=64, block_size=16)
    big = "w" * 10_000_000  # beyond MAX_ID_CHARS: served untagged, and never written whole
    s.add_request(make_request("a" * 5_000_000, prompt_len=20, max_tokens=1, workflow=big, turn=0))
    s.add_request(make_request("b", prompt_len=20, max_tokens=1,
                               extra_args={"mars_workflow": "\ud800", "mars_turn": 1e400, "x": [math.nan]}))
    while s.has_requests():
        step(s)
    assert_no_leaks(s)
    log = s._sched_log
    s.shutdown()
    assert log.closed
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and max(map(len, lines)) < 2000, [len(x) for x in lines]
    first, second = json.loads(lines[0]), json.loads(lines[1])
    assert first["request_id"].endswith("(5000000 chars)") and first["tagged"] is False
    assert first["extra_args"]["mars_workflow"].endswith("(10000000 chars)")
    assert second["tagged"] is False and second["extra_args"]["mars_workflow"] == "\ud800"


# -- defect 11: PolicyQueue as a RequestQueue ----------------------------------------------------
def _loaded(policy: str, clock: VirtualClock):
    """Requests running, waiting and (for retaining policies) one workflow's KV retained."""
    s = make_scheduler(policy, num_blocks=40, block_size=16, max_num_seqs=2, max_num_batched_tokens=256,
                       clock=clock)
    s.add_request(make_request("ret-0", prompt_len=64, max_tokens=1, workflow="ret", turn=0, last_step=False))
    while s.has_requests():
        step(s)
    for i in range(5):
        s.add_request(make_request(f"q{i}", prompt_len=48 + 16 * i, max_tokens=4, workflow=f"wf{i % 2}",
                                   turn=i // 2, last_step=False))
        clock.advance(0.01)
    step(s)
    return s


def _steps(s, clock: VirtualClock, most: int) -> None:
    """Step until idle (at most ``most`` steps), checking block invariants, 10 ms a step."""
    for _ in range(most):
        if not s.has_requests():
            break
        step(s)
        assert_block_invariants(s)
        clock.advance(0.01)


def _drain(s, clock: VirtualClock) -> None:
    _steps(s, clock, 500)
    clock.advance(10_000)
    s.schedule()
    s.release_retention()
    assert_no_leaks(s)


@pytest.mark.parametrize("policy", POLICIES)
def test_waiting_queue_indexes_and_iterates_in_scheduling_order(policy):
    clock = VirtualClock()
    s = _loaded(policy, clock)
    q = s.waiting
    assert len(q) >= 2, policy
    order = list(q)
    assert [q[i] for i in range(len(q))] == order and q[-1] is order[-1]
    assert order[0] in q and q.peek_request() is q[0]
    popped = [q.pop_request() for _ in range(len(order))]
    assert popped == order  # iteration order is the order vLLM takes them in
    q.prepend_requests(reversed(popped))
    assert sorted(r.request_id for r in q) == sorted(r.request_id for r in order)
    _drain(s, clock)


@pytest.mark.parametrize("policy", POLICIES)
def test_reset_prefix_cache_with_running_requests_under_every_policy(policy):
    clock = VirtualClock()
    s = _loaded(policy, clock)
    assert s.running
    if policy in RETAINING:
        assert s.retention.num_blocks > 0, "the scenario must hold retained KV"
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert not s.running and s.retention.num_blocks == 0
    assert s.waiting[0].status == RequestStatus.PREEMPTED or s.waiting[0].status == RequestStatus.WAITING
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == s.num_blocks
    _drain(s, clock)


@pytest.mark.parametrize("mode", ["abort", "keep"])
@pytest.mark.parametrize("policy", POLICIES)
def test_pause_sleep_and_resume_under_every_policy(policy, mode):
    """What EngineCore.pause_scheduler / sleep / wake_up do to the scheduler, in their order."""
    clock = VirtualClock()
    s = _loaded(policy, clock)
    if mode == "abort":  # sleep(level>=1) / pause(mode="abort", clear_cache=True)
        s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        s.set_pause_state(PauseState.PAUSED_NEW)
        assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    else:  # pause(mode="keep", clear_cache=True)
        s.set_pause_state(PauseState.PAUSED_ALL)
        assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert s.retention.num_blocks == 0
    s.add_request(make_request("late", prompt_len=32, max_tokens=2, workflow="late", turn=0))
    out = s.schedule()
    assert "late" not in out.num_scheduled_tokens  # paused: nothing new starts
    s.update_from_output(out, fake_model_output(s, out))
    s.set_pause_state(PauseState.UNPAUSED)  # wake_up / resume_scheduler
    _drain(s, clock)


def test_gated_waiting_queue_keeps_the_container_meaning_and_the_gate_is_its_own_method():
    """lightllm holds its waiting head while the predicted peak demand does not fit: the queue stays
    a container (``bool`` agrees with ``len``), the gate answers through ``admits_waiting_head``
    and vLLM's admission cap ``max_num_active_reqs`` (0 while the head is held)."""
    s = make_scheduler("lightllm", num_blocks=40, block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    s.add_request(make_request("big", prompt_len=64, max_tokens=400))
    step(s)
    s.add_request(make_request("held", prompt_len=64, max_tokens=400))
    assert len(s.waiting) == 1 and bool(s.waiting) is True
    assert s.admits_waiting_head() is False
    assert s.max_num_active_reqs == 0
    step(s)
    assert [r.request_id for r in s.waiting] == ["held"] and len(s.running) == 1  # vLLM admitted nothing
    s.finish_requests(["big"], RequestStatus.FINISHED_ABORTED)
    assert s.admits_waiting_head() is True and s.max_num_active_reqs == 8
    step(s)
    assert len(s.waiting) == 0 and bool(s.waiting) is False and len(s.running) == 1
    s.finish_requests(["held"], RequestStatus.FINISHED_ABORTED)
    step(s)
    assert_no_leaks(s)
