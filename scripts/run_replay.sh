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
#   DRY_RUN=1            print the mars command instead of running it
# The variable mapping is scripts/lib/seed_env.sh (shared with the launchers in experiments/scripts/).
set -euo pipefail
cd "$(dirname "$0")/.."
SEED_NAME=run_replay.sh
source scripts/lib/seed_env.sh

seed_mars
seed_gpu
seed_replay_args
if [[ "${DRY_RUN:-0}" == 1 ]]; then seed_run "${MARS[@]}" "${SEED_ARGS[@]}" "$@"; exit 0; fi
echo "+ ${MARS[*]} ${SEED_ARGS[*]} $*" >&2
exec "${MARS[@]}" "${SEED_ARGS[@]}" "$@"
