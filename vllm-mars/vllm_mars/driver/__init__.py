"""The task driver: replay agent workloads through an engine with admission, tools and metrics.

``runner.run_replay`` is the entry point. ``config`` is what a run is (``ReplayConfig``, one settings
class per engine backend, ``RunPlan``: the request resolved once); ``replay`` runs it (arrivals,
admission, workflows, telemetry); ``calibrate`` fits T_ideal's cost model; ``arrivals`` decides when
roots arrive, ``tools`` runs the CPU tool plane (simulated or real, sandboxed), ``backends`` talks to
the engine (in-process vLLM or an OpenAI-compatible HTTP server; the sim's is ``vllm_mars.sim``),
``control`` says what a driver policy name means. Importing this package does not import vllm.
"""
