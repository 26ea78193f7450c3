"""A small built-in multi-turn workload through the in-process CPU engine with MarsScheduler.

Each workflow runs ``turns`` calls; turn k's prompt is turn k-1's prompt plus its output plus a
tool output, so prefixes really are shared. KV is constrained so the engine must preempt. Prints
per-workflow latency and the engine's counters. (The task driver, ``mars compare``, replaces this
as the main job once it lands.)
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass, field

from vllm_mars.engine.local import engine_kwargs
from vllm_mars.tiny_model import build_tiny_model


@dataclass
class DemoWorkflow:
    wid: str
    prompt: list[int]
    turns: int
    out_tokens: list[int]
    tool_tokens: list[int]
    turn_latency: list[float] = field(default_factory=list)
    done_turns: int = 0


def make_workflows(n: int, turns: int, seed: int = 0) -> list[DemoWorkflow]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 4000) for _ in range(64)]  # a shared system prefix
    out = []
    for i in range(n):
        task = [rng.randrange(3, 4000) for _ in range(rng.randint(96, 256))]
        out.append(DemoWorkflow(f"wf{i:02d}", system + task, turns,
                                [rng.randint(24, 64) for _ in range(turns)],
                                [rng.randint(16, 96) for _ in range(turns)]))
    return out


def run_engine_workload(engine, workflows: list[DemoWorkflow], seed: int = 0) -> float:
    """Drive ``workflows`` through a step-wise ``LLMEngine`` (tools take zero time). Returns seconds."""
    from vllm import SamplingParams

    rng = random.Random(seed)
    pending = {}
    t0 = time.perf_counter()

    def submit(wf: DemoWorkflow) -> None:
        k = wf.done_turns
        rid = f"{wf.wid}-t{k}"
        sp = SamplingParams(max_tokens=wf.out_tokens[k], ignore_eos=True, temperature=0.0,
                            extra_args={"mars_workflow": wf.wid, "mars_turn": k,
                                        "mars_last_step": k == wf.turns - 1, "mars_tool": "bash"})
        engine.add_request(rid, {"prompt_token_ids": list(wf.prompt)}, sp)
        pending[rid] = (wf, time.perf_counter())

    for wf in workflows:
        submit(wf)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            wf, t_submit = pending.pop(out.request_id)
            gen = list(out.outputs[0].token_ids)
            if len(gen) != wf.out_tokens[wf.done_turns]:
                raise RuntimeError(f"{out.request_id}: {len(gen)} tokens, asked for {wf.out_tokens[wf.done_turns]}")
            wf.turn_latency.append(time.perf_counter() - t_submit)
            wf.prompt += gen + [rng.randrange(3, 4000) for _ in range(wf.tool_tokens[wf.done_turns])]
            wf.done_turns += 1
            if wf.done_turns < wf.turns:
                submit(wf)
    return time.perf_counter() - t0


def run_demo(policy: str = "fcfs", workflows: int = 16, turns: int = 3, num_blocks: int = 40,
             model: str | None = None) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    model = model or str(build_tiny_model())
    args = EngineArgs(**engine_kwargs(model, policy=policy, num_blocks=num_blocks, max_model_len=1024,
                                      max_num_seqs=16, max_num_batched_tokens=512, disable_log_stats=True))
    engine = LLMEngine.from_engine_args(args)
    sched = engine.engine_core.engine_core.scheduler
    wfs = make_workflows(workflows, turns)
    wall = run_engine_workload(engine, wfs)
    stats = sched.mars_stats()
    print(f"\nvllm-mars demo: {workflows} workflows x {turns} turns, policy={policy}, "
          f"KV {num_blocks} blocks x 32 tokens, in-process vLLM CPU engine\n")
    print(f"{'workflow':10s} {'turns':>5s} {'mean turn (ms)':>15s} {'max turn (ms)':>14s} {'E2E (ms)':>10s}")
    e2e = []
    for wf in wfs:
        total = sum(wf.turn_latency)
        e2e.append(total)
        print(f"{wf.wid:10s} {wf.done_turns:5d} {1000 * statistics.mean(wf.turn_latency):15.1f} "
              f"{1000 * max(wf.turn_latency):14.1f} {1000 * total:10.1f}")
    print(f"\nmean E2E {1000 * statistics.mean(e2e):.1f} ms, wall {wall:.2f} s, "
          f"preemptions {stats['preemptions']}, recomputed tokens {stats['recomputed_tokens']}")
    return 0
