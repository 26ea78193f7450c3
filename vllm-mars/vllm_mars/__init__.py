"""vllm-mars: agent-centric serving on stock vLLM (admission control + a scheduler_cls plugin)."""

__version__ = "0.1.0"

#: The vLLM release the engine seams were written and checked against (see engine/compat.py).
REQUIRED_VLLM_VERSION = "0.32.0"
