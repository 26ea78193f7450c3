"""Time real engine steps over a grid of batches, for ``mars profile``.

The grid's requests go through the in-process backend of ``mars replay --backend inprocess``
(``driver.backends.InProcessBackend`` with ``record_steps``), so each step is timed as a run's steps
are: its whole cycle in the serving loop (``engine.step()``, the scheduler snapshot, the outputs'
hand-off to the asyncio thread, the next requests' ``add_request``), with the garbage collector on,
paired with the batch the scheduler chose (``engine.steps.StepRecorder``). A fit to these steps and
a fit to a run's recorded steps describe the same quantity. Grid points:

- prefill (chunk c, context p): a p-token prefix is computed and cached first, then a request of the
  prefix plus c fresh tokens (one output token) is timed: its step is a c-token chunk over p tokens;
- decode (batch b, context L): b requests of L fresh tokens each generate ``decode_steps`` + 1 tokens;
  every step is recorded (the prefill steps, mixed batches included, and the b-wide decode steps).

Prompts are seeded random token ids, fresh per request, so nothing hits the prefix cache by chance.

vLLM is imported when an engine starts, not with the module: ``mars --help`` imports it for its grids.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_mars.backend import Sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grid:
    """Points to time; repeats re-run every point with fresh prompts."""

    chunks: tuple[int, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int = 8
    repeats: int = 3

    def needs(self) -> tuple[int, int, int]:
        """(max chunk, max context length, max batch) the engine must allow."""
        ctx = max(max(self.contexts) + max(self.chunks) + 1, max(self.decode_contexts) + self.decode_steps + 2)
        return max(self.chunks), ctx, max(self.batches)


GRIDS = {
    # the in-process CPU engine with the tiny model (~1 min on 2 busy cores, engine start included)
    "cpu": Grid(chunks=(32, 256, 1024), contexts=(0, 512, 1024), batches=(1, 8, 32),
                decode_contexts=(64, 512, 1536), decode_steps=8, repeats=3),
    # a few seconds: for tests
    "tiny": Grid(chunks=(64, 512), contexts=(0, 512), batches=(1, 8), decode_contexts=(128, 512),
                 decode_steps=3, repeats=1),
    # a GPU serving a paper-scale model (points whose KV does not fit are skipped)
    "gpu": Grid(chunks=(512, 2048, 8192), contexts=(0, 8192, 32768), batches=(1, 16, 64, 256),
                decode_contexts=(1024, 8192, 32768), decode_steps=8, repeats=3),
}


class EngineProfiler:
    """Times a real engine's steps over a :class:`Grid` through the in-process serving loop."""

    def __init__(self, model: str, *, seed: int = 0, **engine_kw: Any) -> None:
        self.model = model
        self.engine_kw = engine_kw
        self.rng = random.Random(seed)
        self.backend: Any = None
        self.vocab = 0
        self._n = 0
        self._calls: list[Coroutine] = []

    async def start(self) -> None:
        from vllm_mars.driver.backends import InProcessBackend  # imports vllm when it starts

        self.backend = InProcessBackend(self.model, time.perf_counter, record_steps=True, **self.engine_kw)
        await self.backend.start()
        self.vocab = self.backend.vocab_size

    def capacity_tokens(self) -> int:
        s = self.backend.scheduler
        return s.kv_cache_config.num_blocks * s.block_size

    async def close(self) -> None:
        if self.backend is not None:
            await self.backend.close()
            self.backend = None

    # -- requests -------------------------------------------------------------------------------------
    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        self._n += 1
        self._calls.append(self.backend.generate(f"mars-profile-{self._n}", prompt, max_tokens, {}))

    async def _drain(self, label: Callable[[list, list], str] | None) -> list[Sample]:
        """Send the added requests together, wait for their answers; the steps they took, each timed
        as the serving loop ran it (label=None: not kept)."""
        first = await self.backend.recorded_steps()
        calls, self._calls = self._calls, []
        await asyncio.gather(*calls)
        last = await self.backend.recorded_steps()
        if label is None:
            return []
        return [Sample(tuple(tuple(p) for p in prefill), tuple(decode), dt, label(prefill, decode))
                for prefill, decode, dt, _added in self.backend.step_times[first:last]]

    # -- the grid -------------------------------------------------------------------------------------
    async def run(self, grid: Grid, progress: Callable[[str], None] | None = None) -> list[Sample]:
        samples: list[Sample] = []
        cap = self.capacity_tokens()
        budget = self.backend.scheduler.max_num_scheduled_tokens
        say = progress or (lambda _m: None)
        # warm-up (first calls of every kernel), not recorded
        self._add(self._ids(min(256, budget)), 4)
        self._add(self._ids(32), 4)
        await self._drain(None)
        # repeats are the outer loop, so each point is timed at several moments (a machine shared with
        # other jobs slows some moments down; the fit down-weights the outliers)
        for rep in range(grid.repeats):
            for p in grid.contexts:
                for c in grid.chunks:
                    if c > budget or p + c > cap // 2:
                        if rep == 0:
                            say(f"skip prefill c={c} ctx={p} (budget {budget}, KV {cap} tokens)")
                        continue
                    prefix = self._ids(p)
                    if p:
                        self._add(prefix, 1)
                        await self._drain(None)
                    self._add(prefix + self._ids(c), 1)
                    samples += await self._drain(lambda _p, _d, c=c, p=p: f"prefill c={c} ctx={p}")
            for L in grid.decode_contexts:
                for b in grid.batches:
                    if b * (L + grid.decode_steps + 1) > cap * 0.9:
                        if rep == 0:
                            say(f"skip decode b={b} ctx={L} (KV {cap} tokens)")
                        continue
                    for _i in range(b):
                        self._add(self._ids(L), grid.decode_steps + 1)
                    samples += await self._drain(lambda pf, _d, b=b, L=L:
                                                 f"{'prefill-mix' if pf else 'decode'} b={b} ctx={L}")
            say(f"round {rep + 1}/{grid.repeats}: {len(samples)} steps timed")
        return samples


def profile_engine(model: str, grid: Grid, *, engine_kw: Mapping[str, Any],
                   progress: Callable[[str], None] | None = None, seed: int = 0) -> list[Sample]:
    """Start an engine, time the grid, stop it."""

    async def go() -> list[Sample]:
        prof = EngineProfiler(model, seed=seed, **engine_kw)
        try:
            await prof.start()
            return await prof.run(grid, progress)
        finally:
            await prof.close()

    return asyncio.run(go())
