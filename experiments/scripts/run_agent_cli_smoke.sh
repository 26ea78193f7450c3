#!/usr/bin/env bash
# The MARS preview's one-request smoke test of the native frontends, under its name (its README,
# step 3): one `mars agents run` per agent in AGENTS (default codex,opencode) with MAX_REQUESTS=1.
# Variables as run_agent_cli_local.sh; OUTPUT_DIR gets one subdirectory per agent.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SEED_NAME=run_agent_cli_smoke.sh
source scripts/lib/seed_env.sh
agents=${AGENTS:-codex,opencode}
agents=${agents//[, ]/ }
export MAX_REQUESTS=${MAX_REQUESTS:-1}
out=${OUTPUT_DIR:-}
seed_mars
seed_gpu
for a in $agents; do
  [[ $a == codex || $a == opencode ]] || seed_die "AGENTS=${AGENTS}: unknown agent '$a'; allowed: codex, opencode"
done
for a in $agents; do
  [[ -n $out ]] && OUTPUT_DIR=$out/$a
  seed_agents_args "$a"
  seed_run "${MARS[@]}" "${SEED_ARGS[@]}" "$@"
done
