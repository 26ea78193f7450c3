"""T_ideal's cost model, fitted from solo calls on the idle engine before a run."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import replace
from typing import Any

from vllm_mars.costmodel import CostModel
from vllm_mars.driver.config import RunPlan, SimEngine

logger = logging.getLogger(__name__)


async def calibrate(backend, vocab: int, max_model_len: int, seed: int = 12345, repeats: int = 2,
                    long_prompt: int = 512) -> CostModel:
    """Fit the T_ideal cost model from solo calls on the idle engine (unique ids: no cache hits).

    Times are read on the event loop's clock: wall time on a real engine, virtual time in the
    simulator (where the solo calls run through the same virtual engine, cheaply and exactly).
    """
    rng = random.Random(seed)
    p1, p2, n = 32, min(long_prompt, max_model_len // 2), 33
    loop_time = asyncio.get_running_loop().time

    async def solo(plen: int, out: int, i: int) -> float:
        ids = [rng.randrange(3, vocab) for _ in range(plen)]
        t = loop_time()
        await backend.generate(f"mars-calibrate-{plen}-{out}-{i}", ids, out, {})
        return loop_time() - t

    await solo(p1, 2, -1)  # warm-up
    t1 = min([await solo(p1, 1, i) for i in range(repeats)])
    t2 = min([await solo(p2, 1, i) for i in range(repeats)])
    t3 = min([await solo(p2, n, i) for i in range(repeats)])
    pm = p2 // 2  # the mid-size prefill: the prefill tokens a step's fixed cost is worth
    mid = (pm, min([await solo(pm, 1, i) for i in range(repeats)])) if p1 < pm else None
    return CostModel.from_solo_calls((p1, t1), (p2, t2), (n, t3), mid=mid,
                                     source="cost model calibrated by solo calls on the idle engine")


async def calibrate_apart(plan: RunPlan, backend: Any, clock: Any) -> CostModel:
    """The T_ideal calibration, leaving the run's engine as a run handed the model finds it.

    Calibrating on the run's own engine left its prompts in the prefix cache (and, in the sim, its
    calls in the policy's learned state), so the one run of a comparison that calibrated (the first)
    started from another state than the others: in the first cell of a sim grid that alone moved
    mars from 285.02 s to 285.52 s. The sim calibrates on an engine of its own (free in virtual
    time) and then sets the loop's clock back to 0 (``VirtualTimeLoop.rewind``: the calibration's
    seconds left on it put every timestamp of the run a float's width off); the in-process engine
    calibrates on itself and then empties its prefix cache; a server behind ``--backend http`` keeps
    the calibration prompts in its cache."""
    if isinstance(plan.engine, SimEngine):
        # one engine of the run's shape, whatever its --replicas (every replica is that engine)
        # (and the profile's step times: a recorded run's are the run's, not its calibration's)
        cal = replace(plan, engine=replace(plan.engine, replicas=None, step_trace=None)).make_backend(clock)
        await cal.start()
        try:
            # Virtual time is free: the sim calibrates over longer prompts, closer to its contexts.
            return await calibrate(cal, 4096, plan.max_model_len, long_prompt=SimEngine.calibrate_prompt)
        finally:
            await cal.close()
            if not asyncio.get_running_loop().rewind():
                logger.debug("virtual clock not rewound after the calibration: a timer is pending")
    # Its calls are not the run: the scheduler's uncalibrated warning waits for the run's first step
    # (by then the driver has pinned what they measured; with a model of its own, it warns then).
    defer = getattr(getattr(backend, "scheduler", None), "defer_cost_warning", None)
    if defer is not None:
        defer(True)
    try:
        cost = await calibrate(backend, 4096, plan.max_model_len, long_prompt=512)
    finally:
        if defer is not None:
            defer(False)
    reset = getattr(backend, "reset_prefix_cache", None)
    if reset is not None and not await reset():
        logger.warning("the engine's prefix cache could not be emptied after calibration: the run starts "
                       "with the calibration prompts cached")
    return cost
