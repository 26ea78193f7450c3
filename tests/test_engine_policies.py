"""Every registered policy runs the same small multi-turn workload to completion on the real vLLM
CPU engine (in-process, tiny model, constrained KV), leak-free. ``infercept_swap`` is left out: it
refuses the CPU build by design (checked here too)."""

from __future__ import annotations

import gc
import random

import pytest
from vllm_mars.demo import DemoWorkflow, run_engine_workload
from vllm_mars.engine.rig import assert_no_leaks
from vllm_mars.policies import available_policies

POLICIES = [p for p in available_policies() if p != "infercept_swap"]


def _workflows(n: int = 4, turns: int = 3, seed: int = 3) -> list[DemoWorkflow]:
    """Small multi-turn workflows sharing a 64-token system prefix (about 100-300 tokens each)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 4000) for _ in range(64)]
    return [DemoWorkflow(f"wf{i}", system + [rng.randrange(3, 4000) for _ in range(rng.randint(32, 96))], turns,
                         [rng.randint(8, 16) for _ in range(turns)], [rng.randint(16, 32) for _ in range(turns)])
            for i in range(n)]


def _engine(model: str, policy: str, num_blocks: int = 12):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_mars.engine.local import engine_kwargs

    # 12 blocks x 32 tokens = 352 usable tokens (also max_model_len) for 4 workflows of up to 272
    # tokens each: KV pressure.
    args = EngineArgs(**engine_kwargs(model, policy=policy, num_blocks=num_blocks, max_model_len=352,
                                      max_num_seqs=8, max_num_batched_tokens=256, disable_log_stats=True))
    return LLMEngine.from_engine_args(args)


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_runs_multi_turn_workload_on_cpu_engine(tiny_model, policy):
    from vllm_mars.engine.scheduler import MarsScheduler

    engine = _engine(tiny_model, policy)
    try:
        sched = engine.engine_core.engine_core.scheduler
        assert isinstance(sched, MarsScheduler) and sched.mars_config.policy == policy
        wfs = _workflows()
        run_engine_workload(engine, wfs)  # raises if a call returns the wrong number of tokens
        assert all(wf.done_turns == 3 for wf in wfs)
        # every retained turn was returned to (the last turns never retain): nothing to release
        assert_no_leaks(sched)
    finally:
        del engine
        gc.collect()


def test_infercept_swap_refuses_the_cpu_engine(tiny_model):
    with pytest.raises(Exception, match="no CPU-offload connector"):
        _engine(tiny_model, "infercept_swap")
