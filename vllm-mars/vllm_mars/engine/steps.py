"""What vLLM scheduled in a step, in the step-time profile's terms.

``scheduled_batch(scheduler_output)`` turns a ``SchedulerOutput`` into the two lists
``Profile.step_seconds`` takes: ``prefill`` = (chunk tokens, tokens already computed) per request
scheduled for more than one token, ``decode`` = tokens already computed per request scheduled for
exactly one token. (A one-token chunk and a decode cost the same in the roofline: one query over the
context, so the split needs no request state.) ``StepRecorder`` wraps a live scheduler's
``schedule()`` to record the batch of every step, for ``mars profile``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Batch = tuple[list[tuple[int, int]], list[int]]


def scheduled_batch(out: Any) -> Batch:
    """(prefill, decode) of one ``vllm.v1.core.sched.output.SchedulerOutput``."""
    n_sched: dict[str, int] = out.num_scheduled_tokens
    prefill: list[tuple[int, int]] = []
    decode: list[int] = []

    def add(req_id: str, computed: int) -> None:
        n = n_sched.get(req_id, 0)
        if n == 1:
            decode.append(computed)
        elif n > 1:
            prefill.append((n, computed))

    for r in out.scheduled_new_reqs:
        add(r.req_id, r.num_computed_tokens)
    cached = out.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        add(req_id, computed)
    return prefill, decode


@dataclass
class StepRecorder:
    """Records the batch of every ``schedule()`` of ``scheduler`` (an instance attribute wrapper)."""

    scheduler: Any
    batches: list[Batch] = field(default_factory=list)

    def __post_init__(self) -> None:
        inner = self.scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            self.batches.append(scheduled_batch(out))
            return out

        self.scheduler.schedule = schedule

    def take(self) -> list[Batch]:
        """The batches recorded since the last call."""
        got, self.batches = self.batches, []
        return got
