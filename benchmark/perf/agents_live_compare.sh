#!/usr/bin/env bash
# Live policy comparison with real agents (issue 30): 16 sessions of OpenHands, Codex and OpenCode
# (mixed, open-loop arrivals) on the scripted tiny model, once per policy, with a KV pool small
# enough that the sessions' contexts do not all fit. Each policy gets a fresh `mars serve` pinned to
# CPU_SERVER; the agents run on CPU_AGENT. Writes OUT/compare.json and OUT/report.md (mars compare's
# format) and OUT/rps<R>/<policy>/ run dirs (each with workload.jsonl).
#
# Environment: POLICIES (mars,fcfs), SESSIONS (16), RPS (0.25), NUM_BLOCKS (2048), CPU_SERVER (0),
# CPU_AGENT (1), OUT (runs/agents_live_compare_<time>). Needs scripts/setup.sh and scripts/setup_agents.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=$(.venv/bin/python -c 'from vllm_mars.tiny_model import build_tiny_model; print(build_tiny_model())')
export CPU_SERVER=${CPU_SERVER:-0} CPU_AGENT=${CPU_AGENT:-1}
exec .venv/bin/python -m vllm_mars.cli agents compare --policies "${POLICIES:-mars,fcfs}" \
  --frontend openhands,codex,opencode --tasks benchmark/tasks/coding.jsonl \
  --model-path "$MODEL" --model tiny --scripted benchmark/tasks/coding.jsonl \
  --num-blocks "${NUM_BLOCKS:-2048}" --rps "${RPS:-0.25}" --max-requests "${SESSIONS:-16}" \
  --max-output-tokens 1024 --session-timeout 1500 \
  --out "${OUT:-runs/agents_live_compare_$(date +%Y%m%d_%H%M%S)}"
