#!/usr/bin/env bash
# The MARS preview's environment builder, under its name. The preview built its modified vLLM from
# source into a conda env `mars`; vllm-mars runs on stock vLLM 0.32.0 from PyPI, so:
#   - with conda and a GPU: `conda env create -f environment.yml -n $CONDA_ENV` (default mars;
#     updated in place if it exists), then `conda activate mars` as in the preview;
#   - otherwise: scripts/setup.sh (./.venv with vLLM's CPU or GPU build), then `source .venv/bin/activate`.
#   MODE, CUDA_VERSION_OVERRIDE, TORCH_CUDA_TAG  accepted; nothing is built, said on stderr
#   PYTHON_BIN  interpreter for the .venv (scripts/setup.sh's PYTHON)
#   DRY_RUN=1   print the command instead
set -euo pipefail
cd "$(dirname "$0")/.."
export SEED_NAME=create_continuum_vllm_conda_env.sh
source scripts/lib/seed_env.sh
[[ -n "${MODE:-}" ]] && seed_note "MODE=$MODE: nothing to build; vllm-mars plugs into stock vLLM 0.32.0 from PyPI"
for v in CUDA_VERSION_OVERRIDE TORCH_CUDA_TAG; do
  [[ -n "${!v:-}" ]] && seed_note "$v=${!v}: not used; PyPI's vLLM 0.32.0 wheel is built for CUDA 13.0 (scripts/setup.sh --check-gpu-only checks the driver)"
done
env_name=${CONDA_ENV:-mars}
if command -v conda >/dev/null 2>&1 && seed_has_gpu; then
  if conda env list | awk '{print $1}' | grep -qx "$env_name"; then
    seed_run conda env update -n "$env_name" -f environment.yml
  else
    seed_run conda env create -n "$env_name" -f environment.yml
  fi
  [[ "${DRY_RUN:-0}" == 1 ]] || seed_note "done: conda activate $env_name"
else
  command -v conda >/dev/null 2>&1 || seed_note "conda not found: building ./.venv with scripts/setup.sh instead of a conda env"
  command -v conda >/dev/null 2>&1 && seed_note "no GPU: building ./.venv with vLLM's CPU build (scripts/setup.sh) instead of the GPU conda env"
  if [[ -n "${PYTHON_BIN:-}" ]]; then export PYTHON=$PYTHON_BIN; fi
  seed_run scripts/setup.sh
  [[ "${DRY_RUN:-0}" == 1 ]] || seed_note "done: source .venv/bin/activate"
fi
