"""Record what vLLM scheduled in every step of a live engine, in the step-time profile's terms.

``StepRecorder`` wraps a scheduler's ``schedule()`` (an instance attribute, so the engine core calls
the wrapper) and keeps each step's ``(prefill, decode)`` as ``engine.rig.batch_shape`` describes it:
``(chunk tokens, tokens already computed)`` per prefilling request and the context per decoding
request, exactly what ``Profile.step_seconds`` and the sim engine take. Used by ``mars profile``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_mars.engine.rig import batch_shape

Batch = tuple[list[tuple[int, int]], list[int]]


@dataclass
class StepRecorder:
    """Records the batch of every ``schedule()`` of ``scheduler`` (and, with ``clock``, when the last
    ``schedule()``, ``update_from_output()`` and ``add_request()`` were entered)."""

    scheduler: Any
    batches: list[Batch] = field(default_factory=list)
    clock: Callable[[], float] | None = None
    scheduled_at: float | None = None
    updated_at: float | None = None
    added_at: float | None = None

    def __post_init__(self) -> None:
        s = self.scheduler
        inner, clock = s.schedule, self.clock

        def schedule(*args: Any, **kwargs: Any) -> Any:
            if clock is not None:
                self.scheduled_at = clock()
            out = inner(*args, **kwargs)
            self.batches.append(batch_shape(s, out))
            return out

        s.schedule = schedule
        if clock is None:
            return
        update, add = s.update_from_output, s.add_request

        def update_from_output(*args: Any, **kwargs: Any) -> Any:
            self.updated_at = clock()
            return update(*args, **kwargs)

        def add_request(*args: Any, **kwargs: Any) -> Any:
            self.added_at = clock()
            return add(*args, **kwargs)

        s.update_from_output, s.add_request = update_from_output, add_request

    def take(self) -> list[Batch]:
        """The batches recorded since the last call."""
        got, self.batches = self.batches, []
        return got
