"""Counting KV block events: what a thrashing run's "KV block removals" are read from.

With vLLM's KV cache events on (``kv_events_config.enable_kv_cache_events``; the ``null``
publisher is enough), :class:`CountingPublisher` wraps vLLM's publisher, counts stored and removed
blocks and forwards every batch. With events off, :func:`count_block_removals` counts removals
where vLLM would turn them into events (the simulator: building one event object per block costs
it a quarter of its time, and it only needs the number).
"""

from __future__ import annotations

from typing import Any


class CountingPublisher:
    """Wraps vLLM's KV-event publisher: counts stored and removed blocks, then forwards the batch.

    A removal is a cached block evicted for reuse.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.blocks_stored = 0
        self.blocks_removed = 0

    def publish(self, batch: Any) -> None:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockRemoved":
                self.blocks_removed += len(ev.block_hashes)
            elif kind == "BlockStored":
                self.blocks_stored += len(ev.block_hashes)
        self._inner.publish(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RemovalCounter:
    """Counts KV block removals where they would become events, with vLLM's KV events off."""

    def __init__(self) -> None:
        self.blocks_removed = 0
        self.blocks_stored = None  # not counted without events


def count_events(scheduler: Any) -> CountingPublisher | None:
    """Wrap ``scheduler``'s KV-event publisher when vLLM's KV events are on; the counter or None."""
    cfg = scheduler.kv_events_config
    if cfg is None or not cfg.enable_kv_cache_events:
        return None
    scheduler.kv_event_publisher = CountingPublisher(scheduler.kv_event_publisher)
    return scheduler.kv_event_publisher


def count_block_removals(block_pool: Any) -> RemovalCounter:
    """Count the hashes vLLM would publish as ``BlockRemoved`` events, with events OFF: every
    removal passes through ``BlockPool._emit_block_removed_events``, which returns at once when
    events are off."""
    counter = RemovalCounter()
    emit = block_pool._emit_block_removed_events

    def counting_emit(block_hashes):
        counter.blocks_removed += len(block_hashes)
        return emit(block_hashes)

    block_pool._emit_block_removed_events = counting_emit
    return counter
