#!/usr/bin/env bash
# The MARS preview's policy smoke test, under its name (its README, step 4): every policy over
# every target, one run each, on one GPU (GPU, default 0), or on the CPU build where there is none.
# Writes OUT_ROOT/summary.tsv (target policy requests status exit_code duration_s run_dir) and
# exits 1 if any run failed.
#
#   TARGETS             vllm openhands codex opencode (default: all four; space or comma separated)
#   POLICIES            default: every name `mars replay --policy` accepts
#   VLLM_REQUESTS       task-driver workflows per policy (default 200)
#   OPENHANDS_REQUESTS  OpenHands sessions per policy (default 50)
#   AGENT_CLI_REQUESTS  Codex / OpenCode sessions per policy (default 20)
#   OUT_ROOT            default runs/policy_smoke/<timestamp>;  STOP_ON_FAILURE=1 stops at the first failure
#   plus the variables of run_baseline_continuum.sh and run_agent_cli_local.sh (DRY_RUN=1 prints
#   every mars command). infercept_swap needs a GPU and is skipped, and said so, without one.
set -uo pipefail
cd "$(dirname "$0")/../.."
export SEED_NAME=run_policy_smoke_gpu1.sh
source scripts/lib/seed_env.sh
export GPU=${GPU:-0}
seed_gpu
seed_policies
targets=${TARGETS:-vllm openhands codex opencode}
targets=${targets//,/ }
for t in $targets; do
  case $t in vllm|openhands|codex|opencode) ;; *) seed_die "TARGETS: unknown target '$t'; allowed: vllm, openhands, codex, opencode" ;; esac
done
OUT_ROOT=${OUT_ROOT:-runs/policy_smoke/$(date +%Y%m%d_%H%M%S)}
TSV="$OUT_ROOT/summary.tsv"
if [[ "${DRY_RUN:-0}" != 1 ]]; then
  mkdir -p "$OUT_ROOT"
  printf 'target\tpolicy\trequests\tstatus\texit_code\tduration_s\trun_dir\n' > "$TSV"
fi
here=experiments/scripts
failed=0
for t in $targets; do
  for policy in $SEED_POLICIES; do
    seed_policy_env "$policy"
    run_dir="$OUT_ROOT/$t/$policy"
    case $t in
      vllm) n=${VLLM_REQUESTS:-200}
            cmd=(env NUM_REQUESTS="$n" "$here/run_baseline_continuum.sh" --no-progress) ;;
      openhands) n=${OPENHANDS_REQUESTS:-50}
            cmd=(env MAX_REQUESTS="$n" "$here/run_openhands_qwen3_local.sh") ;;
      *) n=${AGENT_CLI_REQUESTS:-20}
            cmd=(env AGENTS="$t" MAX_REQUESTS="$n" "$here/run_agent_cli_local.sh") ;;
    esac
    seed_smoke "$TSV" "$t" "$policy" "$n" "$run_dir" -- env -u NUM_REQUESTS -u MAX_REQUESTS \
      SCHEDULING_POLICY="$policy" OUTPUT_DIR="$run_dir" ENGINE_ARGS="$SEED_POLICY_ENGINE_ARGS" "${cmd[@]}"
    if [[ $? != 0 ]]; then
      failed=$((failed + 1))
      [[ "${STOP_ON_FAILURE:-0}" == 1 ]] && break 2
    fi
  done
done
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
column -t -s $'\t' "$TSV" 2>/dev/null || cat "$TSV"
exit $(( failed > 0 ))
