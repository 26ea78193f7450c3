"""Record what vLLM scheduled in every step of a live engine, in the step-time profile's terms.

``StepRecorder`` wraps a scheduler's ``schedule()`` (an instance attribute, so the engine core calls
the wrapper) and keeps each step's ``(prefill, decode)`` as ``engine.rig.batch_shape`` describes it:
``(chunk tokens, tokens already computed)`` per prefilling request and the context per decoding
request, exactly what ``Profile.step_seconds`` and the sim engine take. Used by ``mars profile``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_mars.engine.rig import batch_shape

Batch = tuple[list[tuple[int, int]], list[int]]


@dataclass
class StepRecorder:
    """Records the batch of every ``schedule()`` of ``scheduler``."""

    scheduler: Any
    batches: list[Batch] = field(default_factory=list)

    def __post_init__(self) -> None:
        inner = self.scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            self.batches.append(batch_shape(self.scheduler, out))
            return out

        self.scheduler.schedule = schedule

    def take(self) -> list[Batch]:
        """The batches recorded since the last call."""
        got, self.batches = self.batches, []
        return got
