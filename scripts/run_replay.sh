#!/usr/bin/env bash
# Replay a workload through vLLM with one policy (`mars replay`), configured by the seed's
# environment variables. Extra arguments are passed to `mars replay` unchanged.
#
#   MODEL_PATH           model dir (default: the tiny CPU model)
#   TASKS_PATH           schema-v1 JSONL workload (default: benchmark/workloads/compact.jsonl)
#   NUM_REQUESTS         root workflows to run (default: all; more than the file cycles it)
#   RPS                  root arrivals per second (default 1.0)
#   EMIT_MODE            rps (fixed i/rps, default) | poisson | trace
#   SCHEDULING_POLICY    fcfs | mars | concur | mars-no-admission | any registered policy (default mars)
#   CPU_GPU              cores for the driver + engine, e.g. 0-7 (default: all)
#   CPU_TOOL             tool cores, e.g. 8-15 (real tools pin one call per core)
#   CUDA_VISIBLE_DEVICES GPU(s) for the engine (exported as is)
#   NUM_BLOCKS           KV blocks (default: 96 on the CPU build, vLLM's own sizing on GPU; 0 = vLLM's)
#   TP                   tensor parallel size (--engine-arg tensor_parallel_size=TP)
#   GPU_MEMORY_UTILIZATION  fraction of GPU memory vLLM may use (--engine-arg gpu_memory_utilization=...)
#   MAX_MODEL_LEN        context limit (--max-model-len)
#   ENGINE_ARGS          more vLLM engine arguments, space-separated KEY=VALUE (each --engine-arg KEY=VALUE),
#                        e.g. ENGINE_ARGS="kv_offloading_size=8" for infercept_swap on GPU
#   TOOLS                simulated (default) | real
#   BACKEND / URL        inprocess (default) | http with URL=http://host:port
#   OUTPUT_DIR           run dir (default: runs/<timestamp>_<policy>)
#   MARS_BIN             the mars executable (default: .venv/bin/mars, else mars on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."

MARS_BIN=${MARS_BIN:-$( [[ -x .venv/bin/mars ]] && echo .venv/bin/mars || command -v mars )}
case "${EMIT_MODE:-rps}" in
  rps) ARRIVAL=fixed ;;
  poisson|poison) ARRIVAL=poisson ;;
  trace) ARRIVAL=trace ;;
  *) echo "run_replay.sh: EMIT_MODE=${EMIT_MODE} unknown; allowed: rps, poisson, trace" >&2; exit 2 ;;
esac

ARGS=(replay --policy "${SCHEDULING_POLICY:-mars}" --rps "${RPS:-1.0}" --arrival "$ARRIVAL"
      --tools "${TOOLS:-simulated}" --backend "${BACKEND:-inprocess}")
[[ -n "${MODEL_PATH:-}" ]] && ARGS+=(--model "$MODEL_PATH")
[[ -n "${TASKS_PATH:-}" ]] && ARGS+=(--workload "$TASKS_PATH")
[[ -n "${NUM_REQUESTS:-}" ]] && ARGS+=(--num-workflows "$NUM_REQUESTS")
[[ -n "${CPU_GPU:-}" ]] && ARGS+=(--cpu-gpu "$CPU_GPU")
[[ -n "${CPU_TOOL:-}" ]] && ARGS+=(--cpu-tool "$CPU_TOOL")
[[ -n "${NUM_BLOCKS:-}" ]] && ARGS+=(--num-blocks "$NUM_BLOCKS")
[[ -n "${URL:-}" ]] && ARGS+=(--url "$URL")
[[ -n "${TP:-}" ]] && ARGS+=(--engine-arg "tensor_parallel_size=$TP")
[[ -n "${GPU_MEMORY_UTILIZATION:-}" ]] && ARGS+=(--engine-arg "gpu_memory_utilization=$GPU_MEMORY_UTILIZATION")
[[ -n "${MAX_MODEL_LEN:-}" ]] && ARGS+=(--max-model-len "$MAX_MODEL_LEN")
for kv in ${ENGINE_ARGS:-}; do ARGS+=(--engine-arg "$kv"); done
[[ -n "${OUTPUT_DIR:-}" ]] && ARGS+=(--out "$OUTPUT_DIR")
[[ -n "${CUDA_VISIBLE_DEVICES:-}" ]] && export CUDA_VISIBLE_DEVICES

echo "+ $MARS_BIN ${ARGS[*]} $*" >&2
exec "$MARS_BIN" "${ARGS[@]}" "$@"
