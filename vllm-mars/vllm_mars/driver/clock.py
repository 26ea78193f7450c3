"""``RunClock``: seconds since a run's start on the event loop's clock (wall or virtual)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class RunClock:
    """Seconds since the run start on ``time_fn`` (the event loop's clock: monotonic on a real loop,
    virtual in the simulator); before ``start`` it counts from construction. ``epoch`` is the wall
    time of the start, None on a virtual clock (a virtual run has no wall-clock instant)."""

    def __init__(self, time_fn: Callable[[], float] = time.monotonic, virtual: bool = False) -> None:
        self._time = time_fn
        self.virtual = virtual
        self.start()

    @classmethod
    def of_loop(cls, loop: asyncio.AbstractEventLoop) -> RunClock:
        return cls(loop.time, bool(getattr(loop, "virtual", False)))

    def start(self) -> None:
        self.t0 = self._time()
        self.epoch = None if self.virtual else time.time()

    def __call__(self) -> float:
        return self._time() - self.t0
