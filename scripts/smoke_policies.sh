#!/usr/bin/env bash
# Run every registered policy (plus mars / concur / mars-no-admission) on the first N workflows
# of a workload, one `mars replay` each (scripts/run_replay.sh), and write summary.tsv:
#   target  policy  requests  status  exit_code  duration_s  run_dir
#
#   POLICIES          space- or comma-separated list (default: every name `mars replay --policy` accepts)
#   NUM_REQUESTS      first N workflows (default 4)
#   TASKS_PATH        workload (default: benchmark/workloads/compact.jsonl)
#   RPS               arrivals per second (default 2.0)
#   OUT_ROOT          output root (default: runs/policy_smoke/<timestamp>)
#   STOP_ON_FAILURE   1: stop at the first failing policy (default 0)
#   DRY_RUN           1: print the commands only
#   KV_OFFLOADING_SIZE  GiB of host memory for infercept_swap's KV offloading connector (default 4;
#                     the policy refuses to start without one; skipped, and said so, without a GPU)
#   plus MODEL_PATH, CPU_GPU, CPU_TOOL, CUDA_VISIBLE_DEVICES, NUM_BLOCKS, TOOLS, TP,
#   GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, ENGINE_ARGS as in run_replay.sh (scripts/lib/seed_env.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
SEED_NAME=smoke_policies.sh
source scripts/lib/seed_env.sh

N=${NUM_REQUESTS:-4}
OUT_ROOT=${OUT_ROOT:-runs/policy_smoke/$(date +%Y%m%d_%H%M%S)}
seed_policies
TSV="$OUT_ROOT/summary.tsv"
if [[ "${DRY_RUN:-0}" != 1 ]]; then
  mkdir -p "$OUT_ROOT"
  printf 'target\tpolicy\trequests\tstatus\texit_code\tduration_s\trun_dir\n' > "$TSV"
fi

failed=0
for policy in $SEED_POLICIES; do
  seed_policy_env "$policy"
  seed_smoke "$TSV" vllm "$policy" "$N" "$OUT_ROOT/$policy" -- \
    env SCHEDULING_POLICY="$policy" NUM_REQUESTS="$N" RPS="${RPS:-2.0}" OUTPUT_DIR="$OUT_ROOT/$policy" \
        ENGINE_ARGS="$SEED_POLICY_ENGINE_ARGS" scripts/run_replay.sh --no-progress
  rc=$?
  if [[ $rc != 0 ]]; then
    failed=$((failed + 1))
    [[ "${STOP_ON_FAILURE:-0}" == 1 ]] && break
  fi
done
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
column -t -s $'\t' "$TSV" 2>/dev/null || cat "$TSV"
exit $(( failed > 0 ))
