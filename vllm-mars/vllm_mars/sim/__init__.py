"""Virtual-time engine: vLLM's own scheduler above a step-time model on a virtual clock (docs/sim.md)."""
