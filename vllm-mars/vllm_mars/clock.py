"""Clocks. Every policy and the scheduler read time from one injected clock, so tests and the
simulator can drive virtual time while production uses the monotonic clock."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic timeline (the origin is arbitrary)."""
        ...


class MonotonicClock:
    """Wall time from ``time.monotonic``."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Time that moves only when told to: for tests and the simulator."""

    __slots__ = ("_t",)

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError(f"a clock cannot go back: advance({dt})")
        self._t += dt
        return self._t

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"a clock cannot go back: set({t}) < now {self._t}")
        self._t = float(t)
