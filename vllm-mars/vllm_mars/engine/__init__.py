"""The only code that touches vLLM internals: MarsScheduler and its helpers."""
