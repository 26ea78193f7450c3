"""Retention priced by the tool a finished call is about to run (issue 10, item 4).

The next tool comes from vLLM's tool-call parser on the call's output (``tool_parser``), else the
client's ``mars_next_tool``, else the previous tool (``mars_tool``). Gaps are learned under the
tool that ran in them and looked up under the same tool. Real scheduler (``engine.rig``), virtual
clock, every scenario ending with the leak check.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from vllm.tokenizers import cached_get_tokenizer
from vllm_mars.clock import VirtualClock
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.engine.next_tool import NextToolReader
from vllm_mars.engine.rig import (
    assert_no_leaks,
    fake_model_output,
    make_request,
    make_scheduler,
    run_to_completion,
)
from vllm_mars.workflow import MAX_ID_CHARS, workflow_from_extra_args

QUICK, SLOW = 0.2, 8.0
COST = {"cost_model": {"prefill_s_per_token": 2e-3, "source": "test"}}


def _finish(s, clock: VirtualClock) -> None:
    run_to_completion(s)
    clock.advance(10_000)
    s.schedule()
    s.release_retention()
    assert_no_leaks(s)


def _learn(s, clock: VirtualClock, workflow: str, tool: str, gap: float, turns: int = 4) -> None:
    """``turns`` calls of ``workflow``, each running ``tool`` (gap ``gap``) before the next."""
    for k in range(turns):
        last = k == turns - 1
        xargs = {"mars_next_tool": tool} if not last else {}
        s.add_request(make_request(f"{workflow}-{k}", prompt_len=96 + k, max_tokens=1, workflow=workflow,
                                   turn=k, last_step=last, tool=tool if k else None, extra_args=xargs))
        run_to_completion(s)
        if not last:
            clock.advance(gap)


def _tau_after(policy: str, prev_tool: str, next_tool: str | None):
    """Learn QUICK gaps for ``quick`` and SLOW for ``slow``; then a call that ran ``prev_tool`` and is
    about to run ``next_tool`` finishes. Returns (scheduler, clock, retained tau or None)."""
    clock = VirtualClock()
    s = make_scheduler(policy, num_blocks=400, block_size=16, clock=clock, policy_options=COST)
    _learn(s, clock, "q", "quick", QUICK)
    _learn(s, clock, "s", "slow", SLOW)
    xargs = {"mars_next_tool": next_tool} if next_tool else {}
    s.add_request(make_request("t-1", prompt_len=160, max_tokens=1, workflow="t", turn=1, last_step=False,
                               tool=prev_tool, extra_args=xargs))
    run_to_completion(s)
    entry = s.retention.get("t")
    return s, clock, None if entry is None else entry.expires - entry.since


@pytest.mark.parametrize(("prev_tool", "next_tool", "gap"),
                         [("slow", "quick", QUICK), ("quick", "slow", SLOW)])
def test_mars_retention_follows_the_next_tools_gaps_not_the_previous_tools(prev_tool, next_tool, gap):
    s, clock, tau = _tau_after("mars", prev_tool, next_tool)
    assert tau == pytest.approx(gap * 1.05 + 1e-3), tau
    # Without mars_next_tool the previous tool is the fallback (today's behaviour).
    _finish(s, clock)
    other = QUICK if gap == SLOW else SLOW
    s, clock, tau = _tau_after("mars", prev_tool, None)
    assert tau == pytest.approx(other * 1.05 + 1e-3), tau
    _finish(s, clock)


def test_infercept_and_continuum_use_the_next_tool_too():
    # infercept: the learned mean of the next tool decides (the slow tool's mean is past break-even).
    s, clock, _ = _tau_after("infercept", "quick", "slow")
    assert s.mars_policy.last_decision.expected_gap == pytest.approx(SLOW)
    _finish(s, clock)
    s, clock, _ = _tau_after("infercept", "slow", "quick")
    assert s.mars_policy.last_decision.expected_gap == pytest.approx(QUICK)
    _finish(s, clock)
    # continuum pins only for a tool whose mean is <= 2 s: the next one, not the previous one.
    for prev_tool, next_tool, pinned in (("slow", "quick", True), ("quick", "slow", False)):
        s, clock, tau = _tau_after("continuum", prev_tool, next_tool)
        assert (tau is not None) is pinned, (prev_tool, next_tool, tau)
        _finish(s, clock)


def test_a_gap_is_learned_under_the_tool_that_ran_in_it():
    # The returning call carries no mars_tool: the gap is keyed by the ended call's next tool.
    clock = VirtualClock()
    s = make_scheduler("mars", num_blocks=400, block_size=16, clock=clock)
    s.add_request(make_request("w-0", prompt_len=64, max_tokens=1, workflow="w", turn=0, last_step=False,
                               tool="grep", extra_args={"mars_next_tool": "bash"}))
    run_to_completion(s)
    clock.advance(1.5)
    s.add_request(make_request("w-1", prompt_len=80, max_tokens=1, workflow="w", turn=1, last_step=True))
    gaps = s.mars_policy.gaps
    assert gaps.tool_samples("bash").values() == [pytest.approx(1.5)] and gaps.tool_samples("grep") is None
    _finish(s, clock)


# -- the tool-parser path -------------------------------------------------------------------------
HERMES_CALL = 'Running the tests.\n<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>'


def _finish_with_output(s, rid: str, output_ids: list[int], **tags) -> None:
    """Serve one call whose sampled tokens are ``output_ids`` (the real scheduler, fake model)."""
    s.add_request(make_request(rid, prompt_len=48, max_tokens=len(output_ids), **tags))
    for tok in output_ids:
        so = s.schedule()
        s.update_from_output(so, fake_model_output(s, so, tok))
    assert rid not in s.requests
    run_to_completion(s)  # reports the finished request


def test_the_tool_parser_reads_the_next_tool_from_the_output(tiny_model):
    tok = cached_get_tokenizer(tiny_model)
    clock = VirtualClock()
    s = make_scheduler("mars", num_blocks=400, block_size=16, clock=clock, model_dir=tiny_model,
                       policy_options={"tool_parser": "hermes"})
    ids = tok.encode(HERMES_CALL, add_special_tokens=False)
    # The parsed name wins over the client's mars_next_tool.
    _finish_with_output(s, "w-0", ids, workflow="w", turn=0, last_step=False,
                        extra_args={"mars_next_tool": "edit"})
    clock.advance(0.7)
    _finish_with_output(s, "w-1", [42], workflow="w", turn=1, last_step=True)  # no mars_tool
    gaps = s.mars_policy.gaps
    assert gaps.tool_samples("run_tests").values() == [pytest.approx(0.7)]
    assert gaps.tool_samples("edit") is None
    # Garbage output: unknown, no exception; the client's tag is the fallback.
    garbage = tok.encode('<tool_call>{"name": oops', add_special_tokens=False)
    _finish_with_output(s, "v-0", garbage, workflow="v", turn=0, last_step=False,
                        extra_args={"mars_next_tool": "edit"})
    clock.advance(0.3)
    _finish_with_output(s, "v-1", [42], workflow="v", turn=1, last_step=True)
    assert gaps.tool_samples("edit").values() == [pytest.approx(0.3)]
    _finish(s, clock)


def test_the_reader_never_raises_and_bounds_what_it_returns(tiny_model):
    tok = cached_get_tokenizer(tiny_model)
    reader = NextToolReader("hermes", tok, max_tokens=64)
    assert reader.read(tok.encode(HERMES_CALL, add_special_tokens=False)) == "run_tests"
    long_name = '<tool_call>{"name": "' + "x" * (MAX_ID_CHARS + 1) + '", "arguments": {}}</tool_call>'
    for bad in ([], [10**9, -5], tok.encode("no tool call here", add_special_tokens=False),
                tok.encode('<tool_call>{"name": 3}</tool_call>', add_special_tokens=False),
                tok.encode(long_name, add_special_tokens=False)):
        assert reader.read(bad) is None
    # Only the tail is parsed: a call whose opening lies before the last 64 tokens is not seen.
    assert reader.read(tok.encode(HERMES_CALL + " pad" * 200, add_special_tokens=False)) is None


def test_tool_parser_config_errors_and_missing_tokenizer(caplog, tmp_path):
    with pytest.raises(ValueError, match="tool-call-parser 'nope' unknown"):
        make_scheduler("mars", policy_options={"tool_parser": "nope"})
    with pytest.raises(ValueError, match="tool_parser"):
        make_scheduler("mars", policy_options={"tool_parser": 3})
    missing = SimpleNamespace(tokenizer=str(tmp_path), tokenizer_mode="auto", tokenizer_revision=None,
                              trust_remote_code=False)
    with caplog.at_level(logging.WARNING, logger="vllm_mars.engine.next_tool"):
        assert NextToolReader.for_model("hermes", missing) is None
    assert any("cannot load the tokenizer" in r.getMessage() for r in caplog.records)


# -- the tag ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["", "x" * (MAX_ID_CHARS + 1), [1], {"a": 1}, True, 1.5, 2**60])
def test_mars_next_tool_is_validated_like_mars_tool(value):
    for key in ("mars_tool", "mars_next_tool"):
        with pytest.raises(ValueError, match=key):
            workflow_from_extra_args({"mars_workflow": "w", key: value}, "r")
    assert workflow_from_extra_args({"mars_workflow": "w", "mars_next_tool": "bash"}, "r").next_tool == "bash"


def test_a_bad_mars_next_tool_is_served_untagged_with_one_warning(caplog):
    s = make_scheduler("mars", num_blocks=64, block_size=16, clock=VirtualClock())
    with caplog.at_level(logging.WARNING, logger="vllm_mars.engine.scheduler"):
        for i in range(2):
            s.add_request(make_request(f"b{i}", prompt_len=20, max_tokens=1, workflow="w", turn=i,
                                       last_step=False, extra_args={"mars_next_tool": ["x"]}))
    assert len([r for r in caplog.records if "mars_next_tool" in r.getMessage()]) == 1
    assert not s.call("b0").workflow.tagged
    run_to_completion(s)
    assert len(s.retention) == 0
    assert_no_leaks(s)


# -- the replay driver's stand-in ------------------------------------------------------------------
def test_replay_sends_the_tool_each_turn_runs_as_mars_next_tool(tmp_path, monkeypatch):
    """In replay the outputs are synthetic: the driver states the tool a real output would name."""
    turns = [{"output_tokens": 8, "tool_s": 0.5, "tool": "bash"},
             {"append_tokens": 16, "output_tokens": 8, "tool_s": 2.0, "tool": "read"},
             {"append_tokens": 16, "output_tokens": 8}]
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps({"schema": "mars_workload_v1", "workflow_id": f"w{i}", "prompt_tokens": 200,
                                      "turns": turns}) + "\n" for i in range(2)))
    log = tmp_path / "sched.jsonl"
    monkeypatch.setenv("MARS_SCHED_LOG", str(log))
    run_replay(ReplayConfig(workload=str(wl), policy="mars", rps=2.0, backend="sim",
                            profile="h200-qwen3-coder-30b-a3b", progress=False, calibrate=False,
                            out=str(tmp_path / "run")))
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    sent = {(r["workflow"], r["turn"]): (r["extra_args"].get("mars_tool"), r["extra_args"].get("mars_next_tool"))
            for r in recs if r["event"] == "arrive"}
    assert sent == {(w, k): v for w in ("w0", "w1")
                    for k, v in enumerate([(None, "bash"), ("bash", "read"), ("read", None)])}
    ends = {(r["workflow"], r["turn"]): r["next_tool"] for r in recs if r["event"] == "end"}
    assert ends[("w0", 0)] == "bash" and ends[("w0", 1)] == "read" and ends[("w0", 2)] is None
