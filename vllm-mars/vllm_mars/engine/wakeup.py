"""Waking vLLM's idle engine core when retained KV is due to expire.

vLLM's ``EngineCoreProc`` (the engine core of ``vllm serve`` and of every multiprocess engine)
blocks on its input queue while the scheduler says it has no requests: on an idle engine nothing
would release a retention at its expiry, and only the next request did. Two seams close that:

* the scheduler's ``has_requests()`` says True once a retention is due (the loop then steps once:
  ``schedule()`` releases it and the step publishes the scheduler stats, so ``/metrics`` shows the
  blocks free), and
* :class:`ExpiryWaker`, one daemon thread, posts vLLM's own ``WAKEUP`` message into the engine
  core's input queue at the next expiry (the message vLLM's shutdown path uses to wake an idle
  loop; the loop handles it as a no-op and asks ``has_requests()`` again). The thread sleeps on a
  condition until then: no polling, no step while nothing is due.

vLLM passes the scheduler no reference to its engine core, so :func:`engine_core_input_queue`
finds the ``EngineCore.__init__`` frame that is constructing the scheduler. In-process engines
(``LLMEngine`` without multiprocessing, the simulator, the rig) have no input queue: whoever steps
them steps them, and nothing changes there.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any


def engine_core_input_queue() -> Any | None:
    """The input queue of the vLLM engine core constructing the caller, or None (none is
    constructing it, or that engine core is stepped in-process and has no queue)."""
    from vllm.v1.engine.core import EngineCore

    code = EngineCore.__init__.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return getattr(frame.f_locals.get("self"), "input_queue", None)
        frame = frame.f_back
    return None


def wakeup_message() -> tuple[Any, None]:
    """vLLM's no-op message that wakes an engine core blocked on its input queue."""
    from vllm.v1.engine import EngineCoreRequestType

    return (EngineCoreRequestType.WAKEUP, None)


class ExpiryWaker:
    """Calls ``wake()`` from one daemon thread once the earliest armed time has come.

    ``arm(when)`` keeps the earliest time armed (a later one is ignored); firing disarms, and the
    scheduler arms the next expiry the next time the engine core is about to wait. ``when`` is on
    ``now``'s timeline. The thread starts at the first ``arm`` and ends at ``close()``.
    """

    def __init__(self, wake: Callable[[], None], now: Callable[[], float]) -> None:
        self._wake = wake
        self._now = now
        self._cond = threading.Condition()
        self._due = math.inf
        self._closed = False
        self._thread: threading.Thread | None = None
        #: times ``wake()`` was called (tests, stats)
        self.wakeups = 0

    @property
    def due(self) -> float:
        return self._due

    def arm(self, when: float) -> None:
        with self._cond:
            if self._closed or when >= self._due:
                return
            self._due = when
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mars-retention-waker", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                wait = self._due - self._now()
                if wait > 0:
                    self._cond.wait(None if wait == math.inf else wait)
                    continue
                self._due = math.inf
                self.wakeups += 1
                self._wake()  # a put_nowait on an unbounded queue: never blocks
