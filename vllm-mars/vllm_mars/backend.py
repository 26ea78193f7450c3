"""What the task driver asks of an engine: the ``Backend`` protocol and the ``CallResult`` of one call.

A ground-floor module: the driver's engines (``driver.backends``: in-process vLLM, an HTTP server)
and the simulator's (``sim.engine.SimBackend``) both implement it, and neither imports the other.
Their readings of a MarsScheduler: :func:`vllm_mars.admission.telemetry.scheduler_sample`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Sample:
    """One timed engine step and what was scheduled in it (prefill chunks as (chunk, prefix) token counts,
    decodes as context lengths); ``label`` names its grid point. Recorded by the engine's profiler,
    fitted by :mod:`vllm_mars.sim.fit`."""

    prefill: tuple[tuple[int, int], ...]
    decode: tuple[int, ...]
    seconds: float
    label: str = ""


@dataclass
class CallResult:
    """One finished call: its output token ids and when its first and last tokens came (run clock)."""

    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int | None
    first_token_ts: float | None
    end_ts: float
    finish_reason: str | None = None


class Backend(Protocol):
    name: str
    #: tokenizer vocabulary size (token ids in prompts must be below it); None until started
    vocab_size: int | None

    async def start(self) -> None: ...

    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       extra_args: Mapping[str, Any], ignore_eos: bool = True) -> CallResult:
        """Replays pass ``ignore_eos`` (exact output lengths); live agents let the model stop."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` in the engine and free its KV (a call the driver gave up on, e.g. timed
        out); a no-op for a request that already finished. ``generate`` calls it when cancelled."""
        ...

    def sample(self) -> Any:
        """The latest engine state as :class:`vllm_mars.admission.base.Telemetry` (cheap; called by the
        telemetry loop; this ground-floor module does not import the admission package). ``ts`` is when it was read
        from the engine, so a reader can tell a stale sample (a stuck or dead engine) from a fresh one."""
        ...

    def engine_stats(self) -> dict[str, Any]:
        """Counters for the summary (policy, preemptions, recomputed tokens, retention)."""
        ...

    async def close(self) -> None: ...
