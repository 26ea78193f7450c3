# Sourced by the device checks (run from the repository root): picks $PYTHON (the project's .venv,
# else python3) and exits 3 with a SKIP line unless an NVIDIA GPU is visible and $PYTHON imports a
# CUDA build of vLLM. $SKIP_WHY (optional) replaces the default reason for the second case.
PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIP: no NVIDIA GPU visible (nvidia-smi -L failed)"; exit 3
fi
nvidia-smi -L
if ! "$PYTHON" - <<'PYEOF'
import sys
try:
    import torch, vllm
    from vllm.platforms import current_platform
except Exception as e:  # noqa: BLE001
    print(f"SKIP: vLLM not importable: {e}"); sys.exit(3)
print("vllm", vllm.__version__, "torch", torch.__version__, "platform", current_platform.device_type)
sys.exit(0 if current_platform.is_cuda() and torch.cuda.is_available() else 3)
PYEOF
then
  echo "SKIP: $PYTHON: ${SKIP_WHY:-no CUDA build of vLLM}"; exit 3
fi
