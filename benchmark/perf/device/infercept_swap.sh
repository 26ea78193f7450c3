#!/usr/bin/env bash
# Device check for the `infercept_swap` policy on a CUDA GPU (about 2 minutes once vLLM is there).
#
# What it checks, in one in-process vLLM engine (AsyncMarsScheduler, the tiny model, vLLM's native
# CPU KV offloading with --kv-offloading-size):
#   1. the policy starts on "cuda" (it refuses "cpu" by design) and the engine has an offload connector;
#   2. 8 workflows x 4 turns with real tool gaps (0.02-0.6 s) run to completion, every call returning
#      the requested number of tokens;
#   3. the min-waste decisions include both "preserve" (short gap expected) and "swap" (long gap):
#      with T_swap = 4e-5 s/token the swap break-even is 2 * 4e-5 * (C + C_other) seconds;
#   4. no leak: no request, no retention and no KV block left behind.
# Output: $OUT/infercept_swap.json (stats and decisions) and the log on stdout.
#
# Usage (repository root, GPU machine with a CUDA build of vLLM 0.32 importable by $PYTHON):
#   OUT=/tmp/out PYTHON=python3 bash benchmark/perf/device/infercept_swap.sh
# Exit codes: 0 pass, 1 check failed, 3 no CUDA GPU or no CUDA vLLM (nothing was checked).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/infercept_swap_out}
mkdir -p "$OUT"
SKIP_WHY="no CUDA build of vLLM (the CPU build cannot swap); install vllm==0.32.* for CUDA"
source benchmark/perf/device/_cuda_vllm.sh  # sets $PYTHON; exits 3 without a CUDA vLLM
export PYTHONPATH="$PWD/vllm-mars${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

OUT="$OUT" "$PYTHON" - <<'EOF'
import json, os, random, sys, time

from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.llm_engine import LLMEngine

from vllm_mars.engine.local import engine_kwargs
from vllm_mars.engine.rig import assert_no_leaks
from vllm_mars.engine.scheduler import AsyncMarsScheduler, MarsScheduler
from vllm_mars.tiny_model import build_tiny_model

model = str(build_tiny_model())
args = EngineArgs(**engine_kwargs(model, policy="infercept_swap", cpu=False, num_blocks=128, block_size=16,
                                  max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024,
                                  gpu_memory_utilization=0.2, kv_offloading_size=0.5,
                                  kv_offloading_backend="native", disable_log_stats=True))
engine = LLMEngine.from_engine_args(args)
sched = engine.engine_core.engine_core.scheduler
assert isinstance(sched, (MarsScheduler, AsyncMarsScheduler)), type(sched)
assert sched.mars_config.policy == "infercept_swap"
connector = getattr(sched, "connector", None)
print("scheduler", type(sched).__name__, "connector", type(connector).__name__ if connector else None)
failures = []
if connector is None:
    failures.append("no KV connector: --kv-offloading-size did not enable CPU offloading")

rng = random.Random(0)
system = [rng.randrange(3, 4000) for _ in range(128)]
wfs = []
for i in range(8):
    gaps = [0.02 if i % 2 == 0 else 0.6 for _ in range(4)]  # even: short tools, odd: long tools
    wfs.append({"id": f"wf{i}", "prompt": system + [rng.randrange(3, 4000) for _ in range(rng.randint(200, 400))],
                "turn": 0, "gaps": gaps, "due": 0.0})
decisions = []
orig_decide = sched.mars_policy.decide
def decide(call):
    d = orig_decide(call)
    decisions.append({"workflow": call.workflow.workflow, "turn": call.workflow.turn, "action": d.action,
                      "retain_s": d.retain_s, "context": d.context, "other": d.other,
                      "expected_gap": d.expected_gap})
    return d
sched.mars_policy.decide = decide

pending, cached = {}, []
def submit(wf):
    k = wf["turn"]
    sp = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0,
                        extra_args={"mars_workflow": wf["id"], "mars_turn": k, "mars_last_step": k == 3,
                                    "mars_tool": "short" if wf["id"][-1] in "02468" else "long"})
    rid = f"{wf['id']}-t{k}"
    engine.add_request(rid, {"prompt_token_ids": list(wf["prompt"])}, sp)
    pending[rid] = wf

t0 = time.monotonic()
for wf in wfs:
    submit(wf)
waiting_tool = []
while pending or waiting_tool:
    now = time.monotonic()
    for wf in [w for w in waiting_tool if w["due"] <= now]:
        waiting_tool.remove(wf)
        submit(wf)
    if not engine.has_unfinished_requests():
        time.sleep(0.005)
        continue
    for out in engine.step():
        if not out.finished:
            continue
        wf = pending.pop(out.request_id)
        gen = list(out.outputs[0].token_ids)
        if len(gen) != 16:
            failures.append(f"{out.request_id}: {len(gen)} tokens")
        cached.append({"request": out.request_id, "cached": out.num_cached_tokens})
        wf["prompt"] += gen + [rng.randrange(3, 4000) for _ in range(64)]
        wf["turn"] += 1
        if wf["turn"] < 4:
            wf["due"] = time.monotonic() + wf["gaps"][wf["turn"]]
            waiting_tool.append(wf)
    if time.monotonic() - t0 > 240:
        failures.append("workload did not finish in 240 s"); break

actions = {d["action"] for d in decisions}
if "preserve" not in actions:
    failures.append(f"no preserve decision: {actions}")
if "swap" not in actions:
    failures.append(f"no swap decision: {actions}")
sched.release_retention()
try:
    assert_no_leaks(sched)
except AssertionError as e:
    failures.append(f"leak: {e}")
stats = sched.mars_stats()
report = {"ok": not failures, "failures": failures, "wall_s": round(time.monotonic() - t0, 2),
          "stats": stats, "decisions": decisions, "cached_tokens": cached}
with open(os.path.join(os.environ["OUT"], "infercept_swap.json"), "w") as f:
    json.dump(report, f, indent=2, default=str)
print(json.dumps({k: report[k] for k in ("ok", "failures", "wall_s")}, default=str))
print("actions:", sorted(actions), "retention:", stats["retention"])
sys.exit(0 if not failures else 1)
EOF
