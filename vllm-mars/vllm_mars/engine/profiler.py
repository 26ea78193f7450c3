"""Time real engine steps over a grid of batches, for ``mars profile``.

The real ``LLMEngine`` (with MarsScheduler, in this process) is stepped by hand; each
``engine.step()`` is timed with ``perf_counter`` and paired with what the scheduler scheduled in it
(``StepRecorder``). Grid points:

- prefill (chunk c, context p): a p-token prefix is computed and cached first, then a request of the
  prefix plus c fresh tokens (one output token) is timed: its step is a c-token chunk over p tokens;
- decode (batch b, context L): b requests of L fresh tokens each generate ``decode_steps`` + 1 tokens;
  every step is recorded (the prefill steps, mixed batches included, and the b-wide decode steps).

Prompts are seeded random token ids, fresh per request, so nothing hits the prefix cache by chance.

vLLM is imported when an engine starts, not with the module: ``mars --help`` imports it for its grids.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_mars.backend import Sample
from vllm_mars.engine.local import engine_kwargs

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


#: step timers: wall time (the truth on a quiet machine) or this process's CPU time (all threads), which
#: a machine shared with other jobs inflates much less
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def make_llm_engine(model: str, **kwargs: Any):
    """vLLM's ``LLMEngine`` in this process (engine core included) with MarsScheduler; returns
    (engine, scheduler)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(model, disable_log_stats=True, **kwargs)))
    core = getattr(engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                           "before vllm is imported")
    return engine, core.scheduler


class EngineProfiler:
    """Times ``engine.step()`` of a real engine over a :class:`Grid`."""

    def __init__(self, model: str, *, seed: int = 0, clock: str = "wall", **engine_kw: Any) -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock {clock!r} unknown; allowed: {', '.join(CLOCKS)}")
        self.timer = CLOCKS[clock]
        self.model = model
        self.engine_kw = engine_kw
        self.rng = random.Random(seed)
        self.engine = None
        self.scheduler = None
        self.recorder = None
        self.vocab = 0
        self._n = 0

    def start(self) -> None:
        from vllm_mars.engine.steps import StepRecorder  # vllm: imported only when an engine starts

        self.engine, self.scheduler = make_llm_engine(self.model, **self.engine_kw)
        self.recorder = StepRecorder(self.scheduler)
        self.vocab = self.engine.model_config.get_vocab_size()

    def capacity_tokens(self) -> int:
        s = self.scheduler
        return s.kv_cache_config.num_blocks * s.block_size

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.engine_core.shutdown()
            except Exception:
                logger.debug("engine shutdown failed", exc_info=True)
            self.engine = self.scheduler = None

    # -- requests -------------------------------------------------------------------------------------
    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._n += 1
        # as the in-process backend sends them (so detokenization is timed too), unless there is no tokenizer
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.DELTA,
                            detokenize=not self.engine_kw.get("skip_tokenizer_init", False))
        self.engine.add_request(f"mars-profile-{self._n}", {"prompt_token_ids": prompt}, sp)

    def _drain(self, label: Callable[[list, list], str] | None) -> list[Sample]:
        """Step until idle; time every step; label=None: do not record."""
        out: list[Sample] = []
        self.recorder.take()
        gc.collect()
        gc.disable()
        try:
            while self.engine.has_unfinished_requests():
                t0 = self.timer()
                self.engine.step()
                dt = self.timer() - t0
                batches = self.recorder.take()
                if label is None or len(batches) != 1:
                    continue
                prefill, decode = batches[0]
                if prefill or decode:
                    out.append(Sample(tuple(prefill), tuple(decode), dt, label(prefill, decode)))
        finally:
            gc.enable()
        return out

    # -- the grid -------------------------------------------------------------------------------------
    def run(self, grid: Grid, progress: Callable[[str], None] | None = None) -> list[Sample]:
        samples: list[Sample] = []
        cap = self.capacity_tokens()
        budget = self.scheduler.max_num_scheduled_tokens
        say = progress or (lambda _m: None)
        # warm-up (first calls of every kernel), not recorded
        self._add(self._ids(min(256, budget)), 4)
        self._add(self._ids(32), 4)
        self._drain(None)
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
                        self._drain(None)
                    self._add(prefix + self._ids(c), 1)
                    samples += self._drain(lambda _p, _d, c=c, p=p: f"prefill c={c} ctx={p}")
            for L in grid.decode_contexts:
                for b in grid.batches:
                    if b * (L + grid.decode_steps + 1) > cap * 0.9:
                        if rep == 0:
                            say(f"skip decode b={b} ctx={L} (KV {cap} tokens)")
                        continue
                    for _i in range(b):
                        self._add(self._ids(L), grid.decode_steps + 1)
                    samples += self._drain(lambda pf, _d, b=b, L=L:
                                           f"{'prefill-mix' if pf else 'decode'} b={b} ctx={L}")
            say(f"round {rep + 1}/{grid.repeats}: {len(samples)} steps timed")
        return samples


def profile_engine(model: str, grid: Grid, *, engine_kw: Mapping[str, Any],
                   progress: Callable[[str], None] | None = None, seed: int = 0,
                   clock: str = "wall") -> list[Sample]:
    """Start an engine, time the grid, stop it."""
    prof = EngineProfiler(model, seed=seed, clock=clock, **engine_kw)
    prof.start()
    try:
        return prof.run(grid, progress)
    finally:
        prof.close()
