"""What the task driver asks of an engine: the ``Backend`` protocol, the ``CallResult`` of one call,
and engine readings as :class:`~vllm_mars.admission.base.Telemetry`.

A ground-floor module: the driver's engines (``driver.backends``: in-process vLLM, an HTTP server)
and the simulator's (``sim.engine.SimBackend``) both implement it, and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_mars.admission.base import Telemetry


@dataclass
class CallResult:
    """One finished call: its output token ids and when its first and last tokens came (run clock)."""

    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int | None
    first_token_ts: float | None
    end_ts: float
    finish_reason: str | None = None


def EngineSample(ts: float, num_blocks: int | None = None, **fields: Any) -> Telemetry:
    """An engine reading as the one :class:`~vllm_mars.admission.base.Telemetry` (the engine calls
    the pool's size ``num_blocks``; Telemetry ``total_blocks``)."""
    return Telemetry(ts=ts, total_blocks=num_blocks, **fields)


def scheduler_sample(s: Any, ts: float) -> tuple[Telemetry, dict[str, Any]]:
    """(sample, mars_stats) of a MarsScheduler's state now: the in-process and the sim backends'
    telemetry, read straight from the scheduler."""
    st = s.mars_stats()
    free, total = st["free_blocks"], st["num_blocks"]
    return EngineSample(
        ts=ts, free_blocks=free, num_blocks=total, block_size=st["block_size"],
        kv_usage=(1.0 - free / total) if total else None, retained_blocks=st["retained_blocks"],
        preemptions=st["preemptions"], recomputed_tokens=st["recomputed_tokens"],
        kv_blocks_removed=st.get("kv_blocks_removed"), running=len(s.running), waiting=len(s.waiting)), st


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

    def sample(self) -> Telemetry:
        """The latest engine state (cheap; called by the telemetry loop). ``ts`` is when it was read
        from the engine, so a reader can tell a stale sample (a stuck or dead engine) from a fresh one."""
        ...

    def engine_stats(self) -> dict[str, Any]:
        """Counters for the summary (policy, preemptions, recomputed tokens, retention)."""
        ...

    async def close(self) -> None: ...
