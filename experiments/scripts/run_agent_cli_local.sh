#!/usr/bin/env bash
# The MARS preview's Codex/OpenCode launcher, under its name (its README, step 3): the native
# frontends against a local `mars serve`, i.e. `mars agents run --frontend AGENTS`.
#
#   AGENTS  codex (default), opencode, or both (comma or space separated: a mix in one run)
#   MODEL_PATH  TASKS_PATH  MAX_REQUESTS  RPS  EMIT_MODE  SCHEDULING_POLICY  GPU  CPU_SERVER  CPU_AGENT
#   TP  GPU_MEMORY_UTILIZATION  MAX_MODEL_LEN  (and URL, OUTPUT_DIR, DRY_RUN, MARS_BIN, MARS_PYTHON,
#   PYTHON_BIN): see scripts/lib/seed_env.sh. Extra arguments go to `mars agents run`.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SEED_NAME=run_agent_cli_local.sh
source scripts/lib/seed_env.sh
agents=${AGENTS:-codex}
agents=${agents//[, ]/,}
for a in ${agents//,/ }; do
  [[ $a == codex || $a == opencode ]] || seed_die "AGENTS=${AGENTS}: unknown agent '$a'; allowed: codex, opencode"
done
seed_mars
seed_gpu
seed_agents_args "$agents"
seed_run "${MARS[@]}" "${SEED_ARGS[@]}" "$@"
