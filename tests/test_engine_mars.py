"""``mars`` on the real vLLM CPU engine (in-process, tiny model, constrained KV).

Multi-turn workflows with tool gaps on a virtual clock: each turn's prompt is the previous prompt
plus its output plus a tool output, and the next turn arrives after a gap. The run must finish
every turn with its exact token count, retain KV across tool calls, hit the prefix cache on
returning turns, and leave nothing behind.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass, field

import pytest
from vllm_mars.clock import VirtualClock
from vllm_mars.engine.rig import assert_no_leaks

STEP_S = 0.02  # virtual seconds per engine step


@dataclass
class _Wf:
    wid: str
    prompt: list[int]
    outs: list[int]
    tools: list[int]
    gaps: list[float]
    turn: int = 0
    ready: float = 0.0
    live: str | None = None
    cached: list[int] = field(default_factory=list)


def _workflows(n: int, turns: int, seed: int) -> list[_Wf]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 4000) for _ in range(64)]
    return [_Wf(f"wf{i}", system + [rng.randrange(3, 4000) for _ in range(rng.randint(96, 224))],
                [rng.randint(8, 24) for _ in range(turns)], [rng.randint(16, 48) for _ in range(turns)],
                [rng.choice((0.1, 0.3, 0.6, 1.2)) for _ in range(turns)], ready=0.05 * i)
            for i in range(n)]


def _drive(engine, clock: VirtualClock, wfs: list[_Wf], turns: int, seed: int = 0) -> None:
    from vllm import SamplingParams

    rng = random.Random(seed)
    by_id: dict[str, _Wf] = {}
    while True:
        now = clock.now()
        for wf in wfs:
            if wf.live is None and wf.turn < turns and wf.ready <= now:
                rid = f"{wf.wid}-t{wf.turn}"
                sp = SamplingParams(max_tokens=wf.outs[wf.turn], ignore_eos=True, temperature=0.0,
                                    extra_args={"mars_workflow": wf.wid, "mars_turn": wf.turn,
                                                "mars_last_step": wf.turn == turns - 1, "mars_tool": "bash"})
                engine.add_request(rid, {"prompt_token_ids": list(wf.prompt)}, sp)
                wf.live, by_id[rid] = rid, wf
        if not engine.has_unfinished_requests():
            waiting = [wf.ready for wf in wfs if wf.turn < turns]
            if not waiting:
                return
            clock.set(max(clock.now(), min(waiting)))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            wf = by_id.pop(out.request_id)
            gen = list(out.outputs[0].token_ids)
            assert len(gen) == wf.outs[wf.turn], (out.request_id, len(gen))
            wf.cached.append(out.num_cached_tokens or 0)
            wf.prompt += gen + [rng.randrange(3, 4000) for _ in range(wf.tools[wf.turn])]
            wf.ready = clock.now() + wf.gaps[wf.turn]
            wf.turn += 1
            wf.live = None
        clock.advance(STEP_S)


@pytest.fixture(scope="module")
def mars_engine(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_mars.engine.local import engine_kwargs

    # 48 blocks x 32 tokens = 1504 usable tokens for 8 workflows growing to ~400 tokens each.
    args = EngineArgs(**engine_kwargs(tiny_model, policy="mars", num_blocks=48, max_model_len=1024,
                                      max_num_seqs=16, max_num_batched_tokens=512, disable_log_stats=True,
                                      policy_options={"cost_model": {"prefill_s_per_token": 1e-3, "source": "test"}}))
    engine = LLMEngine.from_engine_args(args)
    yield engine
    del engine
    gc.collect()


def test_mars_multi_turn_workload_with_tool_gaps_retains_and_hits_the_prefix_cache(mars_engine):
    from vllm_mars.engine.scheduler import MarsScheduler
    from vllm_mars.policies.mars import MarsPolicy

    sched = mars_engine.engine_core.engine_core.scheduler
    assert isinstance(sched, MarsScheduler) and isinstance(sched.mars_policy, MarsPolicy)
    clock = VirtualClock()
    sched.set_clock(clock)
    turns = 3
    wfs = _workflows(8, turns, seed=11)
    _drive(mars_engine, clock, wfs, turns)
    assert all(wf.turn == turns for wf in wfs)
    stats = sched.mars_stats()
    ret = stats["retention"]
    assert ret["retained"] > 0 and ret["released_on_return"] > 0, stats
    # Returning turns hit their previous context (the 64-token system prefix alone is 2 blocks).
    later = [c for wf in wfs for c in wf.cached[1:]]
    assert sum(c > 64 for c in later) >= len(later) // 4, (later, stats)
    assert stats["prefix_hit_tokens"] > 0
    # The policy learned return gaps from the tool calls it saw.
    assert len(sched.mars_policy.gaps.samples(min_samples=1)) >= 8 * (turns - 1) // 2
    # Anything still retained expires on the clock; then nothing is left.
    clock.advance(1000.0)
    sched.retention.release_expired(clock.now())
    assert_no_leaks(sched)
