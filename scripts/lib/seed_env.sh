# shellcheck shell=bash
# The one mapping of the MARS preview's environment variables (its README's MODEL_PATH, TASKS_PATH,
# NUM_REQUESTS, ...) onto `mars` flags, sourced by scripts/run_replay.sh, scripts/smoke_policies.sh
# and the launchers under the preview's names in experiments/scripts/. A variable with no meaning
# here is accepted and the launcher says on stderr what it did instead.
#
# Every launcher also honours:
#   DRY_RUN=1   print the mars command(s) (one per line, shell-quoted) instead of running them
#   MARS_BIN    the mars executable (default: MARS_PYTHON -m vllm_mars.cli, PYTHON_BIN likewise,
#               .venv/bin/mars, else mars on PATH)
#
# Needs: SEED_NAME (the launcher's name, for messages); run from the repository root.

seed_note() { printf '%s: %s\n' "${SEED_NAME:-seed}" "$*" >&2; }
seed_die() { printf '%s: error: %s\n' "${SEED_NAME:-seed}" "$*" >&2; exit 2; }

# The mars command as an array, MARS=(...).
seed_mars() {
  if [[ -n "${MARS_BIN:-}" ]]; then
    MARS=("$MARS_BIN")
  elif [[ -n "${MARS_PYTHON:-}" ]]; then
    MARS=("$MARS_PYTHON" -m vllm_mars.cli)
  elif [[ -n "${PYTHON_BIN:-}" ]]; then
    MARS=("$PYTHON_BIN" -m vllm_mars.cli)
  elif [[ -x .venv/bin/mars ]]; then
    MARS=(.venv/bin/mars)
  elif command -v mars >/dev/null 2>&1; then
    MARS=(mars)
  else
    seed_die "no mars found: run scripts/setup.sh (or set MARS_BIN / MARS_PYTHON)"
  fi
}

# The Python that has vllm_mars -> SEED_PY (MARS_PYTHON, PYTHON_BIN, .venv/bin/python, python3).
seed_python() {
  SEED_PY=${MARS_PYTHON:-${PYTHON_BIN:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || command -v python3 )}}
}

# 0 when this machine has a GPU vLLM can use (SEED_HAS_GPU=0/1 overrides the probe).
seed_has_gpu() {
  if [[ -n "${SEED_HAS_GPU:-}" ]]; then [[ "$SEED_HAS_GPU" == 1 ]]; return; fi
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

# GPU / CUDA_VISIBLE_DEVICES, and the preview's GPU-only variables on a CPU-only machine.
seed_gpu() {
  if [[ -n "${GPU:-}" && -z "${CUDA_VISIBLE_DEVICES:-}" ]]; then export CUDA_VISIBLE_DEVICES=$GPU; fi
  if seed_has_gpu; then
    [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]] && export CUDA_VISIBLE_DEVICES
    return 0
  fi
  [[ -n "${SEED_GPU_NOTED:-}" ]] && return 0  # a launcher that runs launchers says it once
  export SEED_GPU_NOTED=1
  [[ -n "${GPU:-}${CUDA_VISIBLE_DEVICES:-}" ]] && \
    seed_note "GPU/CUDA_VISIBLE_DEVICES=${GPU:-$CUDA_VISIBLE_DEVICES}: no GPU here, running on the CPU build of vLLM"
  [[ -n "${CPU_CORES:-}" ]] && seed_note "CPU_CORES=$CPU_CORES: not used; CPU_GPU and CPU_TOOL pin the engine and the tools"
  return 0
}

# MODEL_PATH: a local model directory. Without a GPU a path that is not there (the preview's
# default, a 30B model) runs the tiny CPU model instead, said on stderr; with a GPU it is passed on.
seed_model() {
  SEED_MODEL=${MODEL_PATH:-}
  if [[ -n "$SEED_MODEL" && ! -d "$SEED_MODEL" ]] && ! seed_has_gpu; then
    seed_note "MODEL_PATH=$SEED_MODEL is not a local directory and there is no GPU: using the tiny CPU model"
    SEED_MODEL=
  fi
}

# EMIT_MODE -> SEED_ARRIVAL (mars --arrival).
seed_arrival() {
  case "${EMIT_MODE:-rps}" in
    rps) SEED_ARRIVAL=fixed ;;
    poisson|poison) SEED_ARRIVAL=poisson ;;
    trace) SEED_ARRIVAL=trace ;;
    *) seed_die "EMIT_MODE=${EMIT_MODE} unknown; allowed: rps, poisson, trace" ;;
  esac
}

# Engine sizing shared by the replay and the live server: TP, GPU_MEMORY_UTILIZATION,
# MAX_MODEL_LEN, NUM_BLOCKS, ENGINE_ARGS -> SEED_ENGINE_ARGS=(...).
seed_engine_args() {
  SEED_ENGINE_ARGS=()
  [[ -n "${NUM_BLOCKS:-}" ]] && SEED_ENGINE_ARGS+=(--num-blocks "$NUM_BLOCKS")
  [[ -n "${TP:-}" ]] && SEED_ENGINE_ARGS+=(--engine-arg "tensor_parallel_size=$TP")
  [[ -n "${GPU_MEMORY_UTILIZATION:-}" ]] && SEED_ENGINE_ARGS+=(--engine-arg "gpu_memory_utilization=$GPU_MEMORY_UTILIZATION")
  [[ -n "${MAX_MODEL_LEN:-}" ]] && SEED_ENGINE_ARGS+=(--max-model-len "$MAX_MODEL_LEN")
  local kv
  for kv in ${ENGINE_ARGS:-}; do SEED_ENGINE_ARGS+=(--engine-arg "$kv"); done
  return 0
}

# `mars replay` (the preview's task driver) -> SEED_ARGS=(...).
seed_replay_args() {
  seed_arrival; seed_model; seed_engine_args
  SEED_ARGS=(replay --policy "${SCHEDULING_POLICY:-mars}" --rps "${RPS:-1.0}" --arrival "$SEED_ARRIVAL"
             --tools "${TOOLS:-simulated}" --backend "${BACKEND:-inprocess}")
  [[ -n "$SEED_MODEL" ]] && SEED_ARGS+=(--model "$SEED_MODEL")
  [[ -n "${TASKS_PATH:-}" ]] && SEED_ARGS+=(--workload "$TASKS_PATH")
  [[ -n "${NUM_REQUESTS:-}" ]] && SEED_ARGS+=(--num-workflows "$NUM_REQUESTS")
  [[ -n "${CPU_GPU:-}" ]] && SEED_ARGS+=(--cpu-gpu "$CPU_GPU")
  [[ -n "${CPU_TOOL:-}" ]] && SEED_ARGS+=(--cpu-tool "$CPU_TOOL")
  [[ -n "${URL:-}" ]] && SEED_ARGS+=(--url "$URL")
  SEED_ARGS+=("${SEED_ENGINE_ARGS[@]}")
  [[ -n "${OUTPUT_DIR:-}" ]] && SEED_ARGS+=(--out "$OUTPUT_DIR")
  [[ -n "${MAX_REQUESTS:-}" ]] && seed_note "MAX_REQUESTS=$MAX_REQUESTS: the task driver counts NUM_REQUESTS; ignored"
  for v in CPU_SERVER CPU_AGENT; do
    [[ -n "${!v:-}" ]] && seed_note "$v=${!v}: the task driver has no server or agent process; CPU_GPU and CPU_TOOL pin it"
  done
  return 0
}

# `mars agents run` for live frontends ($1: codex, opencode, openhands or a comma list: a mix in
# one run) -> SEED_ARGS=(...). Without URL, `mars agents run` starts `mars serve --model-path` itself
# with the policy and engine sizing given here (--num-blocks, --serve-arg); CPU_SERVER and CPU_AGENT
# are exported for it. With the tiny CPU model the server plays the tasks' scripts (--scripted).
seed_agents_args() {
  local frontends=$1 tasks=${TASKS_PATH:-benchmark/tasks/coding.jsonl} arrival
  seed_arrival; seed_model
  arrival=$SEED_ARRIVAL
  if [[ $arrival == trace ]]; then
    seed_note "EMIT_MODE=trace: live sessions have no recorded arrivals; fixed-rate arrivals at RPS instead"
    arrival=fixed
  fi
  SEED_ARGS=(agents run --frontend "$frontends" --tasks "$tasks" --rps "${RPS:-0.2}" --arrival "$arrival")
  [[ -n "${MAX_REQUESTS:-}" ]] && SEED_ARGS+=(--max-requests "$MAX_REQUESTS")
  if [[ -n "${URL:-}" ]]; then
    SEED_ARGS+=(--server "$URL")
    [[ -n "$SEED_MODEL${TP:-}${GPU_MEMORY_UTILIZATION:-}${MAX_MODEL_LEN:-}${NUM_BLOCKS:-}${ENGINE_ARGS:-}${SCHEDULING_POLICY:-}" ]] && \
      seed_note "URL=$URL: the server is already running; its model, policy and engine sizing are its own"
  else
    SEED_ARGS+=(--policy "${SCHEDULING_POLICY:-mars}")
    if [[ -n "$SEED_MODEL" ]]; then
      SEED_ARGS+=(--model-path "$SEED_MODEL")
    else
      local tiny
      seed_python
      tiny=$("$SEED_PY" -c 'from vllm_mars.tiny_model import build_tiny_model; print(build_tiny_model())') \
        || seed_die "cannot build the tiny model (mars tiny-model) with $SEED_PY"
      SEED_ARGS+=(--model-path "$tiny" --model tiny --scripted "$tasks")
      seed_note "the tiny CPU model plays the tasks' scripted solutions (mars serve --scripted $tasks)"
    fi
    [[ -n "${NUM_BLOCKS:-}" ]] && SEED_ARGS+=(--num-blocks "$NUM_BLOCKS")
    [[ -n "${TP:-}" ]] && SEED_ARGS+=("--serve-arg=--engine-arg=tensor_parallel_size=$TP")
    [[ -n "${GPU_MEMORY_UTILIZATION:-}" ]] && \
      SEED_ARGS+=("--serve-arg=--engine-arg=gpu_memory_utilization=$GPU_MEMORY_UTILIZATION")
    [[ -n "${MAX_MODEL_LEN:-}" ]] && SEED_ARGS+=("--serve-arg=--max-model-len=$MAX_MODEL_LEN")
    local kv
    for kv in ${ENGINE_ARGS:-}; do SEED_ARGS+=("--serve-arg=--engine-arg=$kv"); done
  fi
  [[ -n "${OUTPUT_DIR:-}" ]] && SEED_ARGS+=(--out "$OUTPUT_DIR")
  [[ -n "${CPU_SERVER:-}" ]] && export CPU_SERVER
  [[ -n "${CPU_AGENT:-}" ]] && export CPU_AGENT
  [[ -n "${NUM_REQUESTS:-}" ]] && seed_note "NUM_REQUESTS=$NUM_REQUESTS: live runs count MAX_REQUESTS; ignored"
  [[ -n "${CPU_GPU:-}${CPU_TOOL:-}" ]] && \
    seed_note "CPU_GPU/CPU_TOOL: live runs pin the server to CPU_SERVER and the agents (and their tools) to CPU_AGENT"
  local oh=${OPENHANDS_VENV:-}
  [[ -z $oh && -n "${OPENHANDS_PYTHON:-}" ]] && oh=$(dirname "$(dirname "$OPENHANDS_PYTHON")")
  if [[ -n $oh && ",$frontends," == *,openhands,* ]]; then
    if [[ $(basename "$oh") == openhands && -x $oh/bin/python ]]; then
      SEED_ARGS+=(--agents-prefix "$(dirname "$oh")")
    else
      seed_note "OPENHANDS_VENV/OPENHANDS_PYTHON=$oh: mars agents run uses the OpenHands venv at \$MARS_AGENTS_PREFIX/openhands (scripts/setup_agents.sh installs it); ignored"
    fi
  fi
  return 0
}

# Run (or with DRY_RUN=1 print) one command; its exit status is the function's.
seed_run() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    local a out=()
    for a in "$@"; do
      if [[ $a =~ ^[A-Za-z0-9_./,:=@%+-]+$ ]]; then out+=("$a"); else out+=("$(printf '%q' "$a")"); fi
    done
    echo "${out[*]}"
    return 0
  fi
  printf '+ %s\n' "$*" >&2
  "$@"
}

# The policies a smoke run covers: POLICIES (space or comma separated), else every name
# `mars replay --policy` accepts -> SEED_POLICIES (a string).
seed_policies() {
  if [[ -n "${POLICIES:-}" ]]; then
    SEED_POLICIES=${POLICIES//,/ }
    return 0
  fi
  seed_python
  SEED_POLICIES=$("$SEED_PY" -c 'from vllm_mars.driver.control import driver_policy_names; print(" ".join(driver_policy_names()))') \
    || seed_die "cannot list the policies with $SEED_PY; set POLICIES"
}

# What a policy needs beyond its name -> SEED_SKIP (a reason to skip it here, or empty) and
# SEED_POLICY_ENGINE_ARGS (ENGINE_ARGS plus the policy's own).
seed_policy_env() {
  SEED_SKIP=
  SEED_POLICY_ENGINE_ARGS=${ENGINE_ARGS:-}
  if [[ $1 == infercept_swap ]]; then
    SEED_POLICY_ENGINE_ARGS="$SEED_POLICY_ENGINE_ARGS kv_offloading_size=${KV_OFFLOADING_SIZE:-4}"
    seed_has_gpu || SEED_SKIP="infercept_swap swaps KV through vLLM's GPU offloading connector (no GPU here)"
  fi
  return 0
}

# One smoke row: seed_smoke TSV TARGET POLICY REQUESTS RUN_DIR -- LAUNCHER...; appends
#   target  policy  requests  status  exit_code  duration_s  run_dir
# to TSV; returns the command's status (0 for a skip). SEED_SKIP (a reason) skips it. With
# DRY_RUN=1 the launcher (which honours DRY_RUN) only prints its mars command.
seed_smoke() {
  local tsv=$1 target=$2 policy=$3 n=$4 run_dir=$5
  shift 6
  if [[ -n "${SEED_SKIP:-}" ]]; then
    seed_note "$target/$policy skipped: $SEED_SKIP"
    [[ "${DRY_RUN:-0}" == 1 ]] || printf '%s\t%s\t%s\tskipped\t-\t0\t%s\n' "$target" "$policy" "$n" "$SEED_SKIP" >> "$tsv"
    return 0
  fi
  if [[ "${DRY_RUN:-0}" == 1 ]]; then "$@"; return; fi  # the launcher prints its own mars command
  echo "== $target / $policy ($n requests) -> $run_dir" >&2
  mkdir -p "$(dirname "$run_dir")"
  local start rc dur status
  start=$(date +%s.%N)
  "$@" > "$run_dir.log" 2>&1
  rc=$?
  dur=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
  status=$([[ $rc == 0 ]] && echo ok || echo FAILED)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$target" "$policy" "$n" "$status" "$rc" "$dur" "$run_dir" >> "$tsv"
  echo "   $status (rc $rc, ${dur}s)" >&2
  [[ $rc == 0 ]] || tail -5 "$run_dir.log" >&2
  return $rc
}
