#!/usr/bin/env bash
# The MARS preview's frontend installer, under its name: installs the pinned Codex and OpenCode
# CLIs (and bubblewrap) with scripts/setup_agents.sh into ./.agents.
#   PYTHON_BIN  the preview ran its setup with it; here the CLIs are npm packages, so it only
#               chooses the interpreter the launchers run mars with (they read PYTHON_BIN too)
#   DRY_RUN=1   print the command instead
set -euo pipefail
cd "$(dirname "$0")/../.."
export SEED_NAME=setup_agent_cli.sh
source scripts/lib/seed_env.sh
[[ -n "${PYTHON_BIN:-}" ]] && \
  seed_note "PYTHON_BIN=$PYTHON_BIN: the agent CLIs are npm packages (no Python); the launchers run mars with it"
seed_run scripts/setup_agents.sh "$@"
