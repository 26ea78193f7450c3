"""A virtual-time asyncio event loop: the clock of the simulator.

Why an event loop and not a discrete-event scheduler of our own: the driver (``Replay``: arrivals,
the per-workflow loop, simulated tools, children, the admission control loop, the sampler,
``wait_for`` timeouts) is asyncio code. Running that very code on a loop whose ``time()`` is
virtual gives ONE driver for the real engine and the simulator: nothing is re-implemented, and
every ``asyncio.sleep``/timeout/timer means virtual seconds.

The loop is asyncio's own selector loop with two changes:

* ``time()`` returns the virtual clock (it starts at 0.0);
* when nothing is ready to run, asyncio asks the selector to wait until the next timer; the
  virtual selector polls for I/O without blocking and instead jumps the clock to that timer.

Virtual time therefore advances only when every task is blocked on a timer (for the simulated
engine: the ``asyncio.sleep(step_seconds)`` of the step in flight). Same inputs -> same order of
callbacks and timers -> the same run, bit for bit. Real threads (``asyncio.to_thread``) still work
but their wall duration is invisible to the virtual clock; the simulator does not use them.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _VirtualSelector(selectors.DefaultSelector):
    """Polls the real selector without blocking; a wait for a timer jumps the virtual clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None):
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:
            # No timer at all: only another thread can wake the loop (as on a real loop).
            return super().select(None)
        self.loop._jump_to_next_timer(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop on a virtual clock (see the module docstring)."""

    #: marks the loop as virtual for readers that must not mix in wall time (``RunClock``)
    virtual = True

    def __init__(self, start: float = 0.0) -> None:
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self._virtual_now = float(start)

    def time(self) -> float:
        return self._virtual_now

    def _jump_to_next_timer(self, timeout: float) -> None:
        # asyncio pops cancelled timers off the heap before it selects, so the head is live; jump
        # exactly to its deadline (timeout was computed from it and may be clamped to a day).
        scheduled = self._scheduled
        target = scheduled[0]._when if scheduled else self._virtual_now + timeout
        self._virtual_now = max(self._virtual_now, target)

    def rewind(self) -> bool:
        """Set the clock back to 0.0 when no timer is pending (cancelled ones are dropped); False
        (clock untouched) otherwise. A run that calibrated on this loop first (the calibration's
        engine runs in virtual time too) then starts on the timeline of one that did not: the same
        float values, so every comparison on them, and the run, bit for bit. Timestamps a float's
        width apart (``0.19999999999999996`` against ``0.2`` seconds) were enough to end the same
        400-workflow run at 979.9 or 986.9 s mean E2E."""
        if any(not h.cancelled() for h in self._scheduled):
            return False
        self._scheduled.clear()
        self._timer_cancelled_count = 0
        self._virtual_now = 0.0
        return True

    def advance_if_idle(self, dt: float) -> bool:
        """Advance the clock by ``dt`` now if nothing would run before then: no callback ready, no
        timer due by then, no I/O. Returns False (clock untouched) otherwise.

        ``await asyncio.sleep(dt)`` in that situation reaches the same instant with the same float
        value (``time() + dt``) after a trip through the loop; the simulated engine uses this to
        skip the trip for consecutive steps while the rest of the run sleeps.
        """
        if not self.idle_for(dt):
            return False
        self._virtual_now += dt
        return True

    def idle_for(self, dt: float) -> bool:
        """True when nothing would run before ``time() + dt``: no callback ready, no timer due by
        then, no I/O (what :meth:`advance_if_idle` checks before it advances)."""
        if self._ready or (self._scheduled and self._scheduled[0]._when <= self._virtual_now + dt):
            return False
        return not (self._selector.get_map() and super(_VirtualSelector, self._selector).select(0))


class LoopClock:
    """The ``Clock`` protocol (``now()``) over an event loop's ``time()``: the scheduler's and the
    policies' clock in the simulator is the very clock the driver runs on."""

    __slots__ = ("_time",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._time = loop.time

    def now(self) -> float:
        return self._time()


def is_virtual(loop: asyncio.AbstractEventLoop | None = None) -> bool:
    """True when ``loop`` (default: the running loop) runs on virtual time."""
    loop = loop or asyncio.get_running_loop()
    return bool(getattr(loop, "virtual", False))


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh :class:`VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
