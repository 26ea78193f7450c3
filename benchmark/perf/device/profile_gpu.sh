#!/usr/bin/env bash
# Fit a GPU step-time profile with `mars profile` on a CUDA GPU (H100 / H200), for `--backend sim`.
#
# What it does: starts vLLM 0.32 in-process (AsyncMarsScheduler, policy fcfs) on the model of the
# BASE profile, times engine.step() over the `gpu` grid (prefill chunks 512/2048/8192 tokens over
# contexts 0/8k/32k; decode batches 1/16/64/256 at contexts 1k/8k/32k; points whose KV does not fit
# are skipped), fits mfu, attn_mfu, bw_eff and the per-step / per-request overheads, and writes
#   $OUT/<BASE>.toml        the fitted profile (copy it over vllm_mars/sim/profiles/<BASE>.toml)
#   $OUT/<BASE>.steps.jsonl every timed step (label, prefill, decode, seconds)
#   $OUT/<BASE>.log         the per-grid-point fit error table
# BASE may be a table-built profile (h200-qwen3-coder-30b-a3b-kernels, from `mars profile
# --from-kernels`): the GPU's measured steps then replace the kernel-table step times, and the written
# profile is the roofline fitted to them (vllm_mars.sim.fit drops the tables).
# MODEL (optional) is a real weights dir; without it the shipped config-only model dir is profiled
# with random weights (vLLM load_format=dummy, no tokenizer): same shapes, same kernels, no download.
#
# Usage (repository root, GPU machine with a CUDA build of vLLM 0.32 importable by $PYTHON):
#   OUT=/tmp/out BASE=h200-qwen3-coder-30b-a3b [MODEL=/models/Qwen3-Coder-30B-A3B-Instruct] \
#     bash benchmark/perf/device/profile_gpu.sh
# Exit codes: 0 fitted, 1 failed, 3 no CUDA GPU or no CUDA vLLM (nothing was measured).
# Written without a GPU at hand: checked by reading and by `bash -n`, not run (say so with its results).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/profile_gpu_out}
BASE=${BASE:-h200-qwen3-coder-30b-a3b}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT"
source benchmark/perf/device/_cuda_vllm.sh  # sets $PYTHON; exits 3 without a CUDA vLLM
nvidia-smi --query-gpu=name,memory.total --format=csv

export PYTHONPATH="$PWD/vllm-mars${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(profile --base "$BASE" --grid gpu --repeats "$REPEATS" --name "$BASE"
      --out "$OUT/$BASE.toml" --samples-out "$OUT/$BASE.steps.jsonl")
if [[ -n "${MODEL:-}" ]]; then ARGS+=(--model "$MODEL"); else ARGS+=(--dummy-weights); fi
set +e
"$PYTHON" -m vllm_mars.cli "${ARGS[@]}" 2>&1 | tee "$OUT/$BASE.log"
rc=${PIPESTATUS[0]}
set -e
if [[ $rc -ne 0 ]]; then echo "FAIL: mars profile exited $rc"; exit 1; fi
# the written file must load (the sim's own validation)
"$PYTHON" -c "import sys; from vllm_mars.sim.profile import load_profile; p = load_profile(sys.argv[1]); \
print(p.name, 'KV tokens', p.kv_capacity_tokens(), 'prefill 8192@32k %.3f s' % p.step_seconds([(8192, 32768)], []), \
'decode 64@32k %.4f s' % p.step_seconds([], [32768] * 64))" "$OUT/$BASE.toml"
echo "PASS: fitted profile in $OUT/$BASE.toml"
