"""AsyncMarsScheduler (the GPU variant) builds and schedules like vLLM's AsyncScheduler."""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm_mars.engine.rig import assert_no_leaks, fake_model_output, make_request, make_scheduler
from vllm_mars.engine.scheduler import AsyncMarsScheduler


def _drive(s, n=6):
    for i in range(n):
        s.add_request(make_request(f"a{i}", prompt_len=40 + 10 * i, max_tokens=12))
    trace = []
    while s.has_requests():
        so = s.schedule()
        trace.append(dict(so.num_scheduled_tokens))
        s.update_from_output(so, fake_model_output(s, so))
    return trace


def test_async_variant_matches_stock_async_scheduler():
    ours = make_scheduler("fcfs", num_blocks=30, scheduler_cls=AsyncMarsScheduler)
    assert isinstance(ours, AsyncScheduler)
    stock = make_scheduler("fcfs", num_blocks=30, scheduler_cls=AsyncScheduler)
    assert _drive(ours) == _drive(stock)
    assert_no_leaks(ours)
    assert_no_leaks(stock)


@pytest.mark.gpu
def test_async_mars_scheduler_serves_on_gpu(tiny_model):
    from vllm import LLM, SamplingParams
    from vllm_mars.engine.local import engine_kwargs

    llm = LLM(**engine_kwargs(tiny_model, policy="fcfs", cpu=False, gpu_memory_utilization=0.2))
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    assert isinstance(sched, AsyncMarsScheduler)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 4
    assert_no_leaks(sched)
