"""The real vLLM CPU engine, in-process, with the tiny model and MarsScheduler(fcfs)."""

from __future__ import annotations

import pytest
from vllm_mars.demo import make_workflows, run_engine_workload
from vllm_mars.engine.rig import assert_no_leaks


@pytest.fixture(scope="module")
def engine(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_mars.engine.local import engine_kwargs

    # 40 blocks x 32 tokens = 1248 usable tokens for 16 workflows of 200-400 tokens: must preempt.
    args = EngineArgs(**engine_kwargs(tiny_model, policy="fcfs", num_blocks=40, max_model_len=1024,
                                      max_num_seqs=16, max_num_batched_tokens=512, disable_log_stats=True,
                                      kv_events=True))
    return LLMEngine.from_engine_args(args)


def test_sixteen_multi_turn_workflows_finish_under_kv_pressure(engine):
    from vllm_mars.engine.scheduler import MarsScheduler

    sched = engine.engine_core.engine_core.scheduler
    assert type(sched) is MarsScheduler and sched.mars_config.policy == "fcfs"
    wfs = make_workflows(16, turns=3, seed=7)
    run_engine_workload(engine, wfs)  # raises if any call returns the wrong number of tokens
    assert all(wf.done_turns == 3 for wf in wfs)
    stats = sched.mars_stats()
    assert stats["preemptions"] >= 1, stats
    assert stats["prefix_hit_tokens"] > 0, "later turns must hit the prefix cache"
    # KV events on: cached blocks were stored, and under this pressure some were evicted for reuse.
    assert stats["kv_blocks_stored"] > 0 and 0 < stats["kv_blocks_removed"] <= stats["kv_blocks_stored"]
    assert_no_leaks(sched)


def test_unknown_policy_fails_at_engine_start(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_mars.engine.local import engine_kwargs

    with pytest.raises(ValueError, match="unknown policy 'no-such-policy'"):  # our launchers refuse first
        engine_kwargs(tiny_model, policy="no-such-policy")
    # A user starting vLLM by hand with the bad name: the engine refuses at start.
    kw = engine_kwargs(tiny_model, policy="fcfs", num_blocks=16, max_model_len=256, max_num_seqs=4,
                       max_num_batched_tokens=256)
    args = EngineArgs(**{**kw, "additional_config": {"mars": {"policy": "no-such-policy"}}})
    with pytest.raises(Exception, match="unknown policy 'no-such-policy'; available policies: .*fcfs"):
        LLMEngine.from_engine_args(args)
