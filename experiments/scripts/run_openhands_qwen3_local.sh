#!/usr/bin/env bash
# The MARS preview's OpenHands launcher, under its name (its README, step 2): OpenHands SDK
# conversations against a local `mars serve`, i.e. `mars agents run --frontend openhands`.
#
#   MODEL_PATH  TASKS_PATH  MAX_REQUESTS  RPS  EMIT_MODE  SCHEDULING_POLICY  GPU  CPU_SERVER  CPU_AGENT
#   OPENHANDS_PYTHON  OPENHANDS_VENV  TP  GPU_MEMORY_UTILIZATION  MAX_MODEL_LEN  (and URL: use a
#   running server; OUTPUT_DIR, DRY_RUN, MARS_BIN, MARS_PYTHON, PYTHON_BIN): see scripts/lib/seed_env.sh.
# Extra arguments go to `mars agents run`.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SEED_NAME=run_openhands_qwen3_local.sh
source scripts/lib/seed_env.sh
seed_mars
seed_gpu
seed_agents_args openhands
seed_run "${MARS[@]}" "${SEED_ARGS[@]}" "$@"
