"""A real run's recorded step times as the sim's step-time model (``--backend sim --step-trace``).

``StepTrace`` wraps a profile: everything (KV pool, limits, the cost model the policies price
rebuilds with) is the profile's, but step ``i`` of the sim costs what step ``i`` of the recorded run
took (``steps.jsonl`` of ``mars replay --backend inprocess --record-steps``; the calibration's steps
are skipped). Fed the same workload, the sim then reproduces that run only if its mechanism does:
arrivals and tool returns seen at the same step boundaries, the same batches, the same preemptions.
Each step's batch is compared with the recorded one; the first difference is reported
(:meth:`StepTrace.trace_stats`), and from there on the times no longer belong to the same batches. Steps
past the end of the recording cost the profile's time.

Arrivals follow the recording too. A real run's driver hands a call to the engine a little later
than the sim's does (the output hand-off to the asyncio thread, a timer's overshoot: 1-3 ms on the
CPU engine), and the real engine starts a step a little after a call arrives at an idle engine (its
wake-up); neither is in any step's time. So each recorded step lists the calls the real engine took
in before it (``added``), and the sim takes each call in before that same step: a call that arrives
earlier waits (:meth:`StepTrace.hold`), and a step waits up to ``ARRIVAL_WAIT_S`` of virtual time for
a call it should take in that has not arrived yet (:meth:`StepTrace.awaits`). Recordings without
``added`` replay with the sim's own arrival timing.

The policies price work as the recorded run's did: a real run's admission controller and scheduler
price with the driver's solo-call calibration on that engine, which its ``events.jsonl`` (beside
``steps.jsonl``) records in ``run_start``'s ``cost_model``; :meth:`StepTrace.cost_model` hands that to
the sim's controller and policies in place of the profile's fit, so mars admits roots at the moments
the real run did. A recording without it (no ``events.jsonl``, or a run without calibration) prices
with the profile's model.

Without it, a sim/real comparison mixes two errors: the step-time model's (a fitted profile charges
every step a smooth function of its batch, while a real engine on a shared machine has slow episodes)
and the mechanism's; the trace takes the first out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_mars.costmodel import CostModel
from vllm_mars.metrics.events import read_jsonl
from vllm_mars.sim.fit import load_samples

#: the longest a replayed step waits (virtual seconds) for a call the real engine took in before it
ARRIVAL_WAIT_S = 0.25


class StepTrace:
    """``profile`` with the step times of a recorded run, step by step (see the module docstring)."""

    arrival_wait_s = ARRIVAL_WAIT_S

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
        #: the calls the real engine took in before each recorded step, and where (step, position)
        self._added: list[list[str]] = []
        for d in read_jsonl(path):  # (load_samples validated the file)
            if d.get("calibration") is not True:
                self._added.append([str(r) for r in d.get("added") or ()])
        self._where = {rid: (i, k) for i, rids in enumerate(self._added) for k, rid in enumerate(rids)}
        self._taken: set[str] = set()
        self._waited = -1
        self.recorded_cost = recorded_cost_model(path)

    def cost_model(self) -> CostModel:
        """The cost model the recorded run's policies priced with, else the profile's."""
        return self.recorded_cost if self.recorded_cost is not None else self._profile.cost_model()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profile, name)

    def step_seconds(self, prefill, decode) -> float:
        i = self._next
        self._next += 1
        if i >= len(self._samples):
            return self._profile.step_seconds(prefill, decode)
        s = self._samples[i]
        # the same batch: the same chunks and decodes, in any order (a step's time does not depend on it;
        # the decode fast-forward lists its decodes before a policy's step hook orders them)
        if sorted(tuple(p) for p in prefill) != sorted(s.prefill) or sorted(decode) != sorted(s.decode):
            self._mismatches += 1
            if self._first_mismatch is None:
                self._first_mismatch = {"step": i, "recorded": {"prefill": s.prefill, "decode": s.decode},
                                        "sim": {"prefill": [tuple(p) for p in prefill], "decode": list(decode)}}
        return s.seconds

    def hold(self, request_id: str) -> bool:
        """Whether the real engine took this call in before a later step than the next one."""
        where = self._where.get(request_id)
        return where is not None and where[0] > self._next

    def order(self, request_id: str) -> tuple[int, int]:
        """Where the real engine took this call in (step, position); calls it never saw last."""
        return self._where.get(request_id, (len(self._added), 0))

    def took(self, request_id: str) -> None:
        """The sim took this call in (before its next step)."""
        self._taken.add(request_id)

    def awaits(self) -> bool:
        """Whether the next step should wait for a call the real engine took in before it that has
        not arrived here (once per step: after ``ARRIVAL_WAIT_S`` it runs without it)."""
        i = self._next
        if i >= len(self._added) or self._waited == i:
            return False
        if all(r in self._taken for r in self._added[i]):
            return False
        self._waited = i
        return True

    def trace_stats(self) -> dict[str, Any]:
        """Recorded steps, sim steps charged, batches that differed and the first of them (None: every
        recorded step's batch was the sim's)."""
        return {"file": self.path, "recorded_steps": len(self._samples), "sim_steps": self._next,
                "mismatched_steps": self._mismatches, "first_mismatch": self._first_mismatch,
                "cost_model": "recorded" if self.recorded_cost is not None else "profile"}


def recorded_cost_model(steps_path: str) -> CostModel | None:
    """The cost model of the run that recorded ``steps_path``: ``run_start``'s ``cost_model`` in the
    ``events.jsonl`` beside it (None: no such file, or the run priced without one)."""
    events = Path(steps_path).with_name("events.jsonl")
    if not events.is_file():
        return None
    for d in read_jsonl(events):
        if isinstance(d, dict) and d.get("event") == "run_start":
            cost = d.get("cost_model")
            return None if cost is None else CostModel.from_dict(cost, where=f"{events}: run_start.cost_model")
    return None
