"""KV thrashing under multi-turn agent workflows: fcfs vs mars and its ablations on the real engine.

32 synthetic workflows (shared system prefix, initial context 200-3000 tokens, 4-8 turns, each turn's prompt = the previous prompt +
its output + a tool output, a tool gap between turns) run through vLLM's CPU engine in-process with
the tiny model and a KV pool far smaller than the working set, once per policy, one process.

Time is virtual and the same for every policy: each engine step advances a VirtualClock (the one
the scheduler and the policy read) by a step-cost model, ``fixed + per_token * scheduled tokens``
(defaults of the order of an 8B model on one GPU), and tool gaps are virtual seconds too. So E2E
differences come only from scheduling decisions (order, recomputation, prefix reuse, retention), not
from noise on this shared 2-core box; the real engine still does all batching, KV allocation,
prefix caching and preemption. Wall time per policy is reported alongside.

    .venv/bin/python benchmark/perf/thrash.py                       # fcfs, mars and the ablations
    .venv/bin/python benchmark/perf/thrash.py --policies fcfs,mars --workflows 8
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_POLICIES = "fcfs,mars,mars-no-mlfq,mars-no-elastic,mars-no-retention"


@dataclass
class Workflow:
    wid: str
    arrival: float
    prompt: list[int]
    outs: list[int]
    tools: list[int]
    gaps: list[float]
    turn: int = 0
    ready: float = 0.0
    submitted: float = 0.0
    live: str | None = None
    finish: float | None = None
    turn_latency: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)


def make_workload(n: int, seed: int, scale: float = 1.0) -> list[Workflow]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 4000) for _ in range(128)]
    wfs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(n / 4.0)  # all roots arrive within ~4 virtual seconds
        turns = rng.randint(4, 8)
        # Initial task context log-uniform in 200..3000 tokens: most turns are short (level 0),
        # some long (level 1 with the default thresholds), as in agent traces.
        task_len = int(math.exp(rng.uniform(math.log(200), math.log(3000))) * scale)
        task = [rng.randrange(3, 4000) for _ in range(task_len)]
        gaps = [min(rng.lognormvariate(math.log(1.0), 0.9), 12.0) for _ in range(turns)]
        wfs.append(Workflow(f"wf{i:02d}", t, system + task,
                            [int(rng.randint(16, 96) * scale) or 1 for _ in range(turns)],
                            [int(rng.randint(32, 256) * scale) for _ in range(turns)], gaps, ready=t))
    return wfs


def run_policy(model: str, policy: str, wfs: list[Workflow], args) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm_mars.clock import VirtualClock
    from vllm_mars.engine.local import engine_kwargs
    from vllm_mars.policies import config_fields, get_policy_class

    # The policy's reload-cost model is calibrated to the same step-cost model the clock uses.
    options = {"reload_per_token_s": args.step_per_token_ms / 1e3, "reload_fixed_s": 0.0}
    options.update(json.loads(args.mars_options or "{}"))
    options = {k: v for k, v in options.items() if k in config_fields(get_policy_class(policy))}
    eargs = EngineArgs(**engine_kwargs(model, policy=policy, policy_options=options, num_blocks=args.num_blocks,
                                       block_size=32, max_model_len=min(8192, (args.num_blocks - 1) * 32), max_num_seqs=32,
                                       max_num_batched_tokens=args.budget, disable_log_stats=True))
    engine = LLMEngine.from_engine_args(eargs)
    sched = engine.engine_core.engine_core.scheduler
    clock = VirtualClock()
    sched.set_clock(clock)
    scheduled_tokens = [0]
    original_schedule = sched.schedule

    def schedule(*a, **kw):  # measure the step's work for the step-cost model
        out = original_schedule(*a, **kw)
        scheduled_tokens[0] = out.total_num_scheduled_tokens
        return out

    sched.schedule = schedule
    rng = random.Random(args.seed + 1)
    by_id: dict[str, Workflow] = {}
    steps = 0
    wall0 = time.perf_counter()
    while True:
        now = clock.now()
        for wf in wfs:
            if wf.live is None and wf.finish is None and wf.ready <= now:
                rid = f"{wf.wid}-t{wf.turn}"
                last = wf.turn == len(wf.outs) - 1
                sp = SamplingParams(max_tokens=wf.outs[wf.turn], ignore_eos=True, temperature=0.0,
                                    extra_args={"mars_workflow": wf.wid, "mars_turn": wf.turn,
                                                "mars_last_step": last, "mars_tool": "bash"})
                engine.add_request(rid, {"prompt_token_ids": list(wf.prompt)}, sp)
                wf.live, wf.submitted, by_id[rid] = rid, now, wf
        if not engine.has_unfinished_requests():
            pending = [wf.ready for wf in wfs if wf.finish is None]
            if not pending:
                break
            clock.set(max(now, min(pending)))
            continue
        scheduled_tokens[0] = 0
        outs = engine.step()
        steps += 1
        clock.advance((args.step_fixed_ms + args.step_per_token_ms * scheduled_tokens[0]) / 1e3)
        now = clock.now()
        for out in outs:
            if not out.finished:
                continue
            wf = by_id.pop(out.request_id)
            gen = list(out.outputs[0].token_ids)
            if len(gen) != wf.outs[wf.turn]:
                raise RuntimeError(f"{out.request_id}: {len(gen)} tokens, asked for {wf.outs[wf.turn]}")
            wf.turn_latency.append(now - wf.submitted)
            wf.cached.append(out.num_cached_tokens or 0)
            wf.live = None
            if wf.turn == len(wf.outs) - 1:
                wf.finish = now
            else:
                wf.prompt = wf.prompt + gen + [rng.randrange(3, 4000) for _ in range(wf.tools[wf.turn])]
                wf.ready = now + wf.gaps[wf.turn]
            wf.turn += 1
    wall = time.perf_counter() - wall0
    stats = sched.mars_stats()
    clock.advance(10_000)
    sched.retention.release_expired(clock.now())
    from vllm_mars.engine.rig import assert_no_leaks

    assert_no_leaks(sched)
    e2e = sorted(wf.finish - wf.arrival for wf in wfs)
    turns = [x for wf in wfs for x in wf.turn_latency]
    result = {
        "policy": policy,
        "preemptions": stats["preemptions"],
        "recomputed_tokens": stats["recomputed_tokens"],
        "prompt_tokens": stats["prompt_tokens"],
        "prefix_hit_tokens": stats["prefix_hit_tokens"],
        "prefix_hit_rate": stats["prefix_hit_tokens"] / max(stats["prompt_tokens"], 1),
        "e2e_mean_s": statistics.mean(e2e),
        "e2e_p95_s": e2e[min(math.ceil(0.95 * len(e2e)) - 1, len(e2e) - 1)],
        "turn_mean_s": statistics.mean(turns),
        "turn_p95_s": sorted(turns)[int(0.95 * (len(turns) - 1))],
        "makespan_s": max(wf.finish for wf in wfs) - min(wf.arrival for wf in wfs),
        "steps": steps,
        "wall_s": wall,
        "retention": stats["retention"],
    }
    del engine, sched
    gc.collect()
    return result


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--workflows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=256, help="KV blocks of 32 tokens (default 256)")
    ap.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens (default 1024)")
    ap.add_argument("--step-fixed-ms", type=float, default=8.0, help="step-cost model: fixed ms per step")
    ap.add_argument("--step-per-token-ms", type=float, default=0.06, help="step-cost model: ms per token")
    ap.add_argument("--mars-options", default="", help="JSON of extra config for the mars policies")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the workload's token counts")
    ap.add_argument("--out", default=str(HERE / "results" / "thrash.json"))
    args = ap.parse_args()

    from vllm_mars.tiny_model import build_tiny_model

    model = str(build_tiny_model())
    results = []
    for policy in args.policies.split(","):
        wfs = make_workload(args.workflows, args.seed, args.scale)
        r = run_policy(model, policy, wfs, args)
        results.append(r)
        print(f"{policy:18s} preempt {r['preemptions']:5d}  recomputed {r['recomputed_tokens']:7d}  "
              f"hit {100 * r['prefix_hit_rate']:5.1f}%  E2E mean {r['e2e_mean_s']:7.2f}s  p95 "
              f"{r['e2e_p95_s']:7.2f}s  turn mean {r['turn_mean_s']:6.3f}s  makespan {r['makespan_s']:7.2f}s  "
              f"wall {r['wall_s']:5.1f}s", flush=True)
    wfs = make_workload(args.workflows, args.seed, args.scale)
    doc = {
        "benchmark": "thrash",
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()}-core, no GPU",
        "command": "python benchmark/perf/thrash.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "workload": {"workflows": args.workflows, "turns": sum(len(w.outs) for w in wfs),
                     "initial_prompt_tokens_mean": statistics.mean(len(w.prompt) for w in wfs),
                     "kv_tokens": (args.num_blocks - 1) * 32},
        "time_model": {"step_fixed_ms": args.step_fixed_ms, "step_per_token_ms": args.step_per_token_ms},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
