"""Keeping a finished call's KV blocks referenced across its tool call.

A retained entry holds one extra reference on each cached (hashed) block of the call, so vLLM's
block pool can neither reuse nor evict them, while the workflow's next call still finds them by
prefix hash. Releasing drops that reference; the blocks then sit in vLLM's free queue as ordinary
evictable prefix cache. Retained blocks are therefore never counted as free.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Retained:
    workflow: str
    request_id: str
    blocks: list[Any]  # vLLM KVCacheBlock, in prefix order
    expires: float
    value: float
    since: float
    #: request id of the workflow's next call once it has arrived (released when it is scheduled)
    returning: str | None = None


@dataclass
class RetentionStats:
    retained: int = 0
    released_on_return: int = 0
    released_on_expiry: int = 0
    released_on_abort: int = 0
    released_under_pressure: int = 0
    released_other: int = 0
    block_seconds: float = 0.0


class RetentionStore:
    """Retained entries keyed by workflow id (one per workflow: a newer call supersedes)."""

    def __init__(self, block_pool: Any) -> None:
        self._pool = block_pool
        self._by_workflow: dict[str, Retained] = {}
        self._num_blocks = 0
        self.stats = RetentionStats()

    def __len__(self) -> int:
        return len(self._by_workflow)

    def __bool__(self) -> bool:
        return bool(self._by_workflow)

    def __contains__(self, workflow: str) -> bool:
        return workflow in self._by_workflow

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def get(self, workflow: str) -> Retained | None:
        return self._by_workflow.get(workflow)

    def entries(self) -> list[Retained]:
        return list(self._by_workflow.values())

    def hold(self, workflow: str, request_id: str, blocks: list[Any], now: float, tau: float,
             value: float) -> None:
        if workflow in self._by_workflow:
            self.release(workflow, now, "other")
        self._pool.touch(blocks)
        self._by_workflow[workflow] = Retained(workflow, request_id, blocks, now + tau, value, now)
        self._num_blocks += len(blocks)
        self.stats.retained += 1
        logger.debug("retain %s: %d blocks for %.3fs", workflow, len(blocks), tau)

    def release(self, workflow: str, now: float, reason: str) -> int:
        entry = self._by_workflow.pop(workflow, None)
        if entry is None:
            return 0
        # Tail blocks first: they are the least likely to be shared by another prefix.
        self._pool.free_blocks(reversed(entry.blocks))
        n = len(entry.blocks)
        self._num_blocks -= n
        st = self.stats
        st.block_seconds += n * max(min(now, entry.expires) - entry.since, 0.0)
        attr = f"released_{reason}" if reason != "pressure" else "released_under_pressure"
        setattr(st, attr, getattr(st, attr) + 1)
        logger.debug("release %s (%s): %d blocks", workflow, reason, n)
        return n

    def next_expiry(self) -> float:
        """When the earliest entry expires (inf when none is held)."""
        return min((e.expires for e in self._by_workflow.values()), default=math.inf)

    def release_expired(self, now: float) -> int:
        expired = [w for w, e in self._by_workflow.items() if e.expires <= now]
        return sum(self.release(w, now, "on_expiry") for w in expired)

    def release_lowest_value(self, now: float) -> int:
        """Release the entry with the lowest expected value (ties: the one expiring first)."""
        if not self._by_workflow:
            return 0
        victim = min(self._by_workflow.values(), key=lambda e: (e.value, e.expires))
        return self.release(victim.workflow, now, "pressure")

    def release_all(self, now: float) -> int:
        return sum(self.release(w, now, "other") for w in list(self._by_workflow))
