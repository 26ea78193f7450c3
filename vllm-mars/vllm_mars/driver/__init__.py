"""The task driver: replay agent workloads through an engine with admission, tools and metrics.

``runner.run_replay`` is the entry point; ``arrivals`` decides when roots arrive, ``tools`` runs the
CPU tool plane (simulated or real, sandboxed), ``backends`` talks to the engine (in-process vLLM or an
OpenAI-compatible HTTP server). Importing this package does not import vllm.
"""
