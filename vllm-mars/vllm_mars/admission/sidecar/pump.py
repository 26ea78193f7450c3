"""Writing a streamed answer to the client as upstream delivers it, with no task wake-up per chunk.

:class:`Pump` is the push consumer of one streamed upstream answer
(:meth:`~vllm_mars.admission.upstream.Response.push`); :func:`finish` completes, inside a task, a
coroutine that was started by hand and had to wait (an ASGI ``send`` or ``receive``).
"""

from __future__ import annotations

import asyncio
import time
import types
from typing import Any


class Pump:
    """The push consumer of one streamed answer (:meth:`~vllm_mars.admission.upstream.Response.push`): called by the upstream
    connection after each read, it writes what the read brought to the client at once, by running
    the ASGI ``send`` coroutine right there. A ``send`` that completes without waiting (the client's
    socket takes the bytes: the usual case) costs no task wake-up; one that has to wait (the client
    is slow) is handed to the task (``pending``), and upstream reading pauses until it is done. The
    task is woken (``wake``) only for the end, a failure, a timeout or a pending write."""

    __slots__ = ("ended", "failure", "last", "pending", "prev", "resp", "rx", "scan", "send", "timed_out",
                 "timeout", "timer", "wake")

    def __init__(self, resp: Any, send: Any, scan: Any, timeout: float | None) -> None:
        self.resp = resp
        self.send = send
        self.scan = scan
        self.timeout = timeout
        self.wake: asyncio.Future = None  # type: ignore[assignment]  (set by the task before each wait)
        #: the last two chunks written (the usage counts sit at the end of the answer)
        self.prev = self.last = b""
        self.ended = self.timed_out = False
        #: an exception ``send`` raised (re-raised by the task)
        self.failure: BaseException | None = None
        #: a ``send`` coroutine that suspended, and the future it waits on
        self.pending: tuple[Any, Any] | None = None
        #: when upstream last sent something, and the read-timeout timer (while the task waits)
        self.rx = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        wake = self.wake
        if wake is None or wake.done():
            return  # the task is on it (it calls again before it next waits)
        resp = self.resp
        if self.timeout is not None:
            self.rx = time.monotonic()
        try:
            chunk = resp.take()
            if chunk:
                if self.scan is not None:
                    self.scan.feed(chunk)
                self.prev, self.last = self.last, chunk
                end = resp.done
                co = self.send({"type": "http.response.body", "body": chunk, "more_body": not end})
                try:
                    fut = co.send(None)
                except StopIteration:
                    if end:
                        self.ended = True
                        wake.set_result(None)
                    elif resp.error is not None:
                        wake.set_result(None)
                    return
                self.pending = (co, fut)  # the client's socket is full: the task waits for it
                self.ended = end
                resp.pause_reading()
                wake.set_result(None)
            elif resp.done or resp.error is not None:
                wake.set_result(None)
        except Exception as e:  # noqa: BLE001 (raised in the task, never in the transport's callback)
            self.failure = e
            wake.set_result(None)

    def expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The read-timeout timer: fires the timeout when upstream has been silent for ``timeout``."""
        wake = self.wake
        if wake.done():
            return
        left = self.rx + self.timeout - time.monotonic()  # type: ignore[operator]
        if left > 0:
            self.timer = loop.call_later(left, self.expire, loop)
            return
        self.timed_out = True
        wake.set_result(None)


@types.coroutine
def finish(co: Any, fut: Any) -> Any:
    """Await the rest of coroutine ``co``, started by hand (``co.send(None)``), which suspended on
    ``fut``; returns its result (cancelling the awaiting task throws into ``co``)."""
    while True:
        try:
            yield fut
        except BaseException as e:  # noqa: BLE001 (passed into the coroutine, which re-raises it)
            try:
                fut = co.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                fut = co.send(None)
            except StopIteration as stop:
                return stop.value
