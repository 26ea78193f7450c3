"""A real run's recorded step times as the sim's step-time model (``--backend sim --step-trace``).

``StepTrace`` wraps a profile: everything (KV pool, limits, the cost model the policies price
rebuilds with) is the profile's, but step ``i`` of the sim costs what step ``i`` of the recorded run
took (``steps.jsonl`` of ``mars replay --backend inprocess --record-steps``; the calibration's steps
are skipped). Fed the same workload, the sim then reproduces that run only if its mechanism does:
arrivals and tool returns seen at the same step boundaries, the same batches, the same preemptions.
Each step's batch is compared with the recorded one; the first difference is reported
(:meth:`StepTrace.trace_stats`), and from there on the times no longer belong to the same batches. Steps
past the end of the recording cost the profile's time.

Without it, a sim/real comparison mixes two errors: the step-time model's (a fitted profile charges
every step a smooth function of its batch, while a real engine on a shared machine has slow episodes)
and the mechanism's; the trace takes the first out.
"""

from __future__ import annotations

from typing import Any

from vllm_mars.sim.fit import load_samples


class StepTrace:
    """``profile`` with the step times of a recorded run, step by step (see the module docstring)."""

    def __init__(self, profile: Any, path: str) -> None:
        self._profile = profile
        self.path = path
        self._samples = load_samples(path, run_only=True)
        if not self._samples:
            raise ValueError(f"{path}: no recorded run steps (record them with mars replay --backend inprocess "
                             "--record-steps)")
        self._next = 0
        self._first_mismatch: dict[str, Any] | None = None
        self._mismatches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profile, name)

    def step_seconds(self, prefill, decode) -> float:
        i = self._next
        self._next += 1
        if i >= len(self._samples):
            return self._profile.step_seconds(prefill, decode)
        s = self._samples[i]
        if tuple(tuple(p) for p in prefill) != s.prefill or tuple(decode) != s.decode:
            self._mismatches += 1
            if self._first_mismatch is None:
                self._first_mismatch = {"step": i, "recorded": {"prefill": s.prefill, "decode": s.decode},
                                        "sim": {"prefill": [tuple(p) for p in prefill], "decode": list(decode)}}
        return s.seconds

    def trace_stats(self) -> dict[str, Any]:
        """Recorded steps, sim steps charged, batches that differed and the first of them (None: every
        recorded step's batch was the sim's)."""
        return {"file": self.path, "recorded_steps": len(self._samples), "sim_steps": self._next,
                "mismatched_steps": self._mismatches, "first_mismatch": self._first_mismatch}
