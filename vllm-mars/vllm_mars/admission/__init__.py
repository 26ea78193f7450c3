"""The admission control plane: pure Python, no vllm import."""
