#!/usr/bin/env bash
# The MARS preview's task-driver launcher, under its name (its README, step 1): one workload through
# the in-process vLLM engine with one scheduling policy, i.e. `mars replay` (scripts/run_replay.sh).
#
#   MODEL_PATH  TASKS_PATH  NUM_REQUESTS  RPS  EMIT_MODE  SCHEDULING_POLICY  CPU_GPU  CPU_TOOL  GPU
#   TP  GPU_MEMORY_UTILIZATION  MAX_MODEL_LEN  (and NUM_BLOCKS, ENGINE_ARGS, TOOLS, OUTPUT_DIR,
#   DRY_RUN, MARS_BIN, MARS_PYTHON, PYTHON_BIN): see scripts/lib/seed_env.sh and docs/workloads.md.
# Without a GPU it runs on the CPU build (the tiny model unless MODEL_PATH is a local directory).
# Extra arguments go to `mars replay`.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SEED_NAME=run_baseline_continuum.sh
source scripts/lib/seed_env.sh
seed_mars
seed_gpu
seed_replay_args
seed_run "${MARS[@]}" "${SEED_ARGS[@]}" "$@"
