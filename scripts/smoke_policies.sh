#!/usr/bin/env bash
# Run every registered policy (plus mars / concur / mars-no-admission) on the first N workflows
# of a workload, one `mars replay` each, and write summary.tsv:
#   policy  requests  status  exit_code  duration_s  run_dir
#
#   POLICIES          space-separated list (default: every name `mars replay --policy` accepts)
#   NUM_REQUESTS      first N workflows (default 4)
#   TASKS_PATH        workload (default: benchmark/workloads/compact.jsonl)
#   RPS               arrivals per second (default 2.0)
#   OUT_ROOT          output root (default: runs/policy_smoke/<timestamp>)
#   STOP_ON_FAILURE   1: stop at the first failing policy (default 0)
#   DRY_RUN           1: print the commands only
#   KV_OFFLOADING_SIZE  GiB of host memory for infercept_swap's KV offloading connector (default 4;
#                     the policy refuses to start without one, and cannot run on the CPU build)
#   plus MODEL_PATH, CPU_GPU, CPU_TOOL, CUDA_VISIBLE_DEVICES, NUM_BLOCKS, TOOLS, TP,
#   GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, ENGINE_ARGS as in run_replay.sh
set -uo pipefail
cd "$(dirname "$0")/.."

MARS_BIN=${MARS_BIN:-$( [[ -x .venv/bin/mars ]] && echo .venv/bin/mars || command -v mars )}
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || command -v python3 )}
N=${NUM_REQUESTS:-4}
OUT_ROOT=${OUT_ROOT:-runs/policy_smoke/$(date +%Y%m%d_%H%M%S)}
POLICIES=${POLICIES:-$("$PY" -c 'from vllm_mars.driver.control import driver_policy_names; print(" ".join(driver_policy_names()))')}
mkdir -p "$OUT_ROOT"
TSV="$OUT_ROOT/summary.tsv"
printf 'policy\trequests\tstatus\texit_code\tduration_s\trun_dir\n' > "$TSV"

failed=0
for policy in $POLICIES; do
  run_dir="$OUT_ROOT/$policy"
  engine_args=${ENGINE_ARGS:-}
  if [[ $policy == infercept_swap ]]; then engine_args="$engine_args kv_offloading_size=${KV_OFFLOADING_SIZE:-4}"; fi
  cmd=(env SCHEDULING_POLICY="$policy" NUM_REQUESTS="$N" RPS="${RPS:-2.0}" OUTPUT_DIR="$run_dir"
       ENGINE_ARGS="$engine_args" scripts/run_replay.sh --no-progress)
  if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "${cmd[*]}"; continue; fi
  echo "== $policy ($N workflows) -> $run_dir" >&2
  start=$(date +%s.%N)
  "${cmd[@]}" > "$OUT_ROOT/$policy.log" 2>&1
  rc=$?
  dur=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
  status=$([[ $rc == 0 ]] && echo ok || echo FAILED)
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$policy" "$N" "$status" "$rc" "$dur" "$run_dir" >> "$TSV"
  echo "   $status (rc $rc, ${dur}s)" >&2
  if [[ $rc != 0 ]]; then
    failed=$((failed + 1))
    tail -5 "$OUT_ROOT/$policy.log" >&2
    [[ "${STOP_ON_FAILURE:-0}" == 1 ]] && break
  fi
done
column -t -s $'\t' "$TSV" 2>/dev/null || cat "$TSV"
exit $(( failed > 0 ))
