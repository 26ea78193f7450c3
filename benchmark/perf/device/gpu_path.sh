#!/usr/bin/env bash
# Device check of the GPU path, for a CUDA host with the project set up (scripts/setup.sh done):
# under 8 minutes with the tiny model. One line per check, then a verdict.
#
#   1. driver   the NVIDIA driver can run vLLM 0.32.0's CUDA 13 build (scripts/setup.sh --check-gpu-only)
#   2. cuda     torch sees the GPU; vLLM 0.32 is the CUDA build
#   3. tests    the `gpu`-marked pytest tests (AsyncMarsScheduler built and serving in-process)
#   4. serve    `mars serve --device gpu --policy mars`: tagged multi-turn calls through the sidecar;
#               prefix-cache hits in vLLM's /metrics, every call's arrive+end in the scheduler log
#               with its workflow tag, no "MARS scheduler mismatch" warning and no traceback
#   5. swap     infercept_swap with vLLM's CPU offloading connector (benchmark/perf/device/infercept_swap.sh):
#               the run completes and swap decisions are counted
#   6. tp2      tensor parallel 2 (only with two or more GPUs): multi-turn calls, then the leak check
# TP 4/8 are not checked: the tiny model has 2 attention heads, which TP 4 or 8 cannot split.
#
# Usage (repository root or anywhere):  OUT=/tmp/gpu_path bash benchmark/perf/device/gpu_path.sh
# Environment: OUT (default /tmp/gpu_path_out), PYTHON (default .venv/bin/python, else python3).
# Exit: 0 every check passed or was skipped for a stated reason, 1 a check failed, 3 no CUDA GPU
# or no CUDA build of vLLM (nothing was checked).
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
OUT=${OUT:-/tmp/gpu_path_out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || command -v python3 )}
export PYTHONPATH="$ROOT/vllm-mars${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
FAILED=0

line() {  # name PASS|FAIL|SKIP detail...
  local name=$1 status=$2; shift 2
  printf '%-7s %-4s %s\n' "$name" "$status" "$*"
  [[ $status == FAIL ]] && FAILED=$((FAILED + 1))
  return 0
}

# 1. driver ----------------------------------------------------------------------------------
platform=$(scripts/setup.sh --check-gpu-only 2>"$OUT/driver.txt"); rc=$?
if [[ $rc != 0 ]]; then
  line driver FAIL "$(tr '\n' ' ' < "$OUT/driver.txt")"; echo "VERDICT: FAIL (driver)"; exit 1
fi
if [[ $platform != gpu ]]; then
  line driver SKIP "no NVIDIA GPU visible (nvidia-smi -L)"; echo "VERDICT: NOTHING CHECKED"; exit 3
fi
line driver PASS "$(tr '\n' ' ' < "$OUT/driver.txt")"

# 2. cuda ------------------------------------------------------------------------------------
if ! info=$("$PYTHON" - 2>&1 <<'EOF'
import sys
import torch, vllm
from vllm.platforms import current_platform
ok = torch.cuda.is_available() and current_platform.is_cuda() and vllm.__version__.startswith("0.32")
print(f"vllm {vllm.__version__} torch {torch.__version__} cuda {torch.version.cuda} "
      f"gpus {torch.cuda.device_count()} platform {current_platform.device_type}")
sys.exit(0 if ok else 3)
EOF
); then
  line cuda FAIL "$(echo "$info" | tail -1)"; echo "VERDICT: NOTHING CHECKED (no CUDA build of vLLM 0.32)"; exit 3
fi
line cuda PASS "$info"
NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
MODEL=$("$PYTHON" -m vllm_mars.cli tiny-model 2>/dev/null | tail -1)

# 3. gpu-marked tests ------------------------------------------------------------------------
timeout 240 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/pytest_gpu.txt" 2>&1; rc=$?
summary=$(grep -E "passed|failed|error|no tests ran" "$OUT/pytest_gpu.txt" | tail -1)
if [[ $rc == 0 ]] && grep -q passed <<<"$summary" && ! grep -q skipped <<<"$summary"; then
  line tests PASS "$summary"
else
  line tests FAIL "rc=$rc $summary (see $OUT/pytest_gpu.txt)"
fi

# 4. mars serve --device gpu --policy mars ----------------------------------------------------
read -r PORT EPORT < <("$PYTHON" - <<'EOF'
import socket
ps = []
for _ in range(2):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); ps.append(s)
print(*[s.getsockname()[1] for s in ps])
EOF
)
SCHED="$OUT/sched.jsonl"; rm -f "$SCHED"
MARS_SCHED_LOG=$SCHED setsid "$PYTHON" -m vllm_mars.cli serve "$MODEL" --device gpu --policy mars \
  --port "$PORT" --engine-port "$EPORT" --served-model-name tiny --max-model-len 2048 \
  --engine-arg gpu_memory_utilization=0.3 --engine-log "$OUT/engine.log" --engine-timeout 240 \
  > "$OUT/serve.log" 2>&1 &
SERVE_PID=$!
SIDE="http://127.0.0.1:$PORT" ENG="http://127.0.0.1:$EPORT" SCHED="$SCHED" OUT="$OUT" \
  timeout 300 "$PYTHON" - > "$OUT/serve_check.txt" 2>&1 <<'EOF'
import json, os, sys, time
import httpx

side, eng, sched = os.environ["SIDE"], os.environ["ENG"], os.environ["SCHED"]
deadline = time.monotonic() + 260
while time.monotonic() < deadline:
    try:
        if httpx.get(side + "/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
else:
    print("FAIL sidecar not healthy in 260 s"); sys.exit(1)
calls, problems = [], []
for w in range(3):
    prompt = f"workflow {w} system prompt: " + "tool call agent turn session " * 40
    for turn in range(3):
        headers = {"X-MARS-Workflow": f"gpu-wf{w}", "X-MARS-Turn": str(turn),
                   "X-MARS-Last-Step": "true" if turn == 2 else "false"}
        r = httpx.post(side + "/v1/completions", headers=headers, timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
        if r.status_code != 200:
            problems.append(f"call w{w} t{turn}: HTTP {r.status_code} {r.text[:200]}")
            continue
        calls.append((f"gpu-wf{w}", turn))
        prompt += r.json()["choices"][0]["text"] + " tool output: grep result config " * 5
metrics = httpx.get(eng + "/metrics", timeout=10).text
hits = sum(float(l.split()[-1]) for l in metrics.splitlines()
           if l.startswith("vllm:prefix_cache_hits_total"))
if hits <= 0:
    problems.append("no prefix-cache hits in /metrics (vllm:prefix_cache_hits_total)")
time.sleep(1)
recs = [json.loads(l) for l in open(sched)] if os.path.exists(sched) else []
for wf, turn in calls:
    evs = {r["event"] for r in recs if r.get("workflow") == wf and r.get("turn") == turn}
    if not {"arrive", "end"} <= evs:
        problems.append(f"{wf} turn {turn} not in the scheduler log (events {sorted(evs)})")
print(f"calls {len(calls)}/9 prefix_hits {hits:.0f} sched_records {len(recs)}")
for p in problems:
    print("FAIL", p)
sys.exit(1 if problems or len(calls) != 9 else 0)
EOF
rc=$?
# Read the logs before shutdown (a stopping server may print tracebacks of its own).
bad_log=$(cat "$OUT/engine.log" "$OUT/serve.log" 2>/dev/null | grep -E "MARS scheduler mismatch|Traceback" | head -2)
# Ctrl-C, as a user stops it: mars serve stops the sidecar, then its vLLM server.
kill -INT -- -"$SERVE_PID" 2>/dev/null
for _ in $(seq 60); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 0.5; done
kill -KILL -- -"$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null
if [[ $rc == 0 && -z $bad_log ]]; then
  line serve PASS "$(head -1 "$OUT/serve_check.txt")"
else
  line serve FAIL "$(grep -m3 -E "FAIL|calls" "$OUT/serve_check.txt" | tr '\n' ' ') $bad_log"
fi

# 5. infercept_swap with a connector ----------------------------------------------------------
OUT="$OUT/swap" PYTHON="$PYTHON" timeout 240 bash benchmark/perf/device/infercept_swap.sh > "$OUT/swap.log" 2>&1; rc=$?
swaps=$("$PYTHON" -c "import json; d=json.load(open('$OUT/swap/infercept_swap.json')); \
print(sum(x['action'] == 'swap' for x in d['decisions']), 'swap /', len(d['decisions']), 'decisions;', d['failures'])" \
  2>/dev/null || echo "no report")
if [[ $rc == 0 ]]; then line swap PASS "$swaps"; else line swap FAIL "rc=$rc $swaps (see $OUT/swap.log)"; fi

# 6. tensor parallel 2 -------------------------------------------------------------------------
if (( NGPU >= 2 )); then
  MODEL="$MODEL" VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 240 "$PYTHON" - > "$OUT/tp2.txt" 2>&1 <<'EOF'
import os, sys
from vllm import LLM, SamplingParams
from vllm_mars.engine.local import engine_kwargs
from vllm_mars.engine.rig import assert_no_leaks
from vllm_mars.engine.scheduler import AsyncMarsScheduler

llm = LLM(**engine_kwargs(os.environ["MODEL"], policy="mars", cpu=False, max_model_len=1024,
                          engine_args={"tensor_parallel_size": 2, "gpu_memory_utilization": 0.3}))
sched = llm.llm_engine.engine_core.engine_core.scheduler
prompts = [[5 + w] * 200 for w in range(4)]
for turn in range(3):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=8, ignore_eos=True, extra_args={
                            "mars_workflow": f"tp{w}", "mars_turn": turn, "mars_last_step": turn == 2})
                         for w in range(4)])
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    prompts = [p + list(o.outputs[0].token_ids) + [9] * 20 for p, o in zip(prompts, outs)]
sched.release_retention()
assert_no_leaks(sched)
print(f"tp2 ok: {type(sched).__name__}, 12 calls, no leak, stats {sched.mars_stats()['preemptions']} preemptions")
sys.exit(0 if isinstance(sched, AsyncMarsScheduler) else 1)
EOF
  rc=$?
  if [[ $rc == 0 ]]; then line tp2 PASS "$(tail -1 "$OUT/tp2.txt")"; else line tp2 FAIL "rc=$rc $(tail -1 "$OUT/tp2.txt")"; fi
else
  line tp2 SKIP "one GPU visible: tensor parallel 2 needs two"
fi
line tp4/8 SKIP "the tiny model has 2 attention heads: TP 4 and 8 cannot be exercised with it"

if (( FAILED )); then echo "VERDICT: FAIL ($FAILED check(s))"; exit 1; fi
echo "VERDICT: PASS"
