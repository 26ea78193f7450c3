"""Serving the sidecar: uvicorn (with uvloop and httptools, as vLLM runs it) behind a connection
guard, :func:`serve_app` for the CLI and :class:`ServerThread` for tests and notebooks. It takes
the app as an argument and imports nothing of :mod:`~vllm_mars.admission.sidecar.app` (which imports
this module: one direction, no import circle).

The guard (a subclass of uvicorn's httptools protocol) bounds what one client can hold:

* ``header_timeout_s``: a request's head (request line and headers) must arrive within this many
  seconds of the connection opening, or of its first byte on a kept-alive connection; otherwise
  408 and the connection is closed (slow-loris, a header line per second);
* ``max_header_bytes``: a head larger than this gets 431 and the connection is closed;
* ``max_connections``: at the cap a new connection first takes the place of an idle keep-alive
  connection (closed), else of the request that has been sending its head or body the longest
  (more than ``SLOW_GRACE_S``; answered 408 and closed), so slow or idle clients cannot lock others
  out; only when every connection is busy with a complete request is it answered 503 and closed;
* ``keep_alive_s``: an idle keep-alive connection is closed after this long.

The body of a request is bounded by the app (``body_timeout_s`` between body chunks and
``body_deadline_s`` for the whole body -> 408, ``max_body_bytes`` -> 413); so is the client's side
of a streamed answer (no bytes taken for ``body_timeout_s``: the call ends and the connection is reset).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import logging.handlers
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Self

logger = logging.getLogger(__name__)


def _raw_response(status: int, reason: str) -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").encode()


class _HeadTooLarge(Exception):
    """Raised inside the parser's callbacks to stop parsing an oversized request head."""


#: a request sending its head or body for longer than this may lose its connection to a new one at the cap
SLOW_GRACE_S = 2.0
#: a scope key of every request served here: the app may put a callable there, called once when the
#: client goes away before its response is complete (so no task per call waits on ``receive`` for it)
ON_DISCONNECT = "mars.on_disconnect"
#: a scope key of every request served here: resets the client's connection (its unsent bytes dropped)
ABORT = "mars.abort"


def guarded_protocol(header_timeout_s: float, max_header_bytes: int, max_connections: int) -> type:
    """uvicorn's httptools protocol with the limits of the module docstring."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = False
        _head_bytes = 0
        _raw_head = 0
        #: when the head now being received began
        _head_since = 0.0
        #: when the request now being received began (None: none is being received)
        _receiving_since: float | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections and not self._make_room():
                logger.warning("connection cap (%d) reached: refusing %s", max_connections, self.client)
                self._reject(503, "Service Unavailable")
                return
            self._arm()

        def _make_room(self) -> bool:
            """At the cap: close an idle keep-alive connection, else the request that has been
            sending its head or body the longest (beyond SLOW_GRACE_S). False: every other
            connection is busy with a complete request (or already closing)."""
            live, victim = 0, None
            oldest = self.loop.time() - SLOW_GRACE_S
            for c in self.connections:
                t = c.transport
                if c is self or t is None or t.is_closing():
                    continue
                live += 1
                if getattr(c, "timeout_keep_alive_task", None) is not None:
                    victim, oldest = c, -1.0  # idle: the first choice
                elif oldest >= 0 and (since := getattr(c, "_receiving_since", None)) is not None and since < oldest:
                    victim, oldest = c, since
            if live < max_connections:
                return True  # the count includes connections already closing
            if victim is None:
                return False
            if oldest < 0:
                victim.transport.close()
            else:
                logger.info("connection cap (%d): closing %s, slowest to send its request", max_connections,
                            victim.client)
                victim._reject(408, "Request Timeout")
            return True

        def _arm(self) -> None:
            self._in_head = True
            self._head_bytes = self._raw_head = 0
            self._receiving_since = self._head_since = self.loop.time()
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            """The head is complete. Its timer stays set: when it fires it checks the head then
            being received, if any (one timer per connection and timeout period, not per request)."""
            self._in_head = False

        def _stop_timer(self) -> None:
            self._in_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _reject(self, status: int, reason: str) -> None:
            self._stop_timer()
            if not self.transport.is_closing():
                self.transport.write(_raw_response(status, reason))
                self.transport.close()

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self._in_head:
                return
            left = self._head_since + header_timeout_s - self.loop.time()
            if left > 1e-3:  # a later request's head: its own deadline
                self._head_timer = self.loop.call_later(left, self._head_timeout)
                return
            logger.info("request head from %s not complete in %s s: closing", self.client, header_timeout_s)
            self._reject(408, "Request Timeout")

        def _count_head(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > max_header_bytes:
                self._reject(431, "Request Header Fields Too Large")
                raise _HeadTooLarge  # stops the parser: no request is started

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._raw_head += len(data)
            super().data_received(data)
            if self._in_head and self._raw_head > max_header_bytes:  # a head still unfinished (one huge line)
                self._reject(431, "Request Header Fields Too Large")

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope[ON_DISCONNECT] = None  # type: ignore[literal-required]
            self.scope[ABORT] = self.transport.abort  # type: ignore[literal-required]
            if not self._in_head:  # the next request on a kept-alive connection
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._receiving_since = None
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            cycle = self.cycle
            gone = cycle.scope.get(ON_DISCONNECT) if cycle is not None and not cycle.response_complete else None
            super().connection_lost(exc)
            if gone is not None:
                gone()

    return GuardedProtocol


def uvicorn_config(app: Any) -> Any:
    """The uvicorn config for a :class:`~vllm_mars.admission.sidecar.app.Sidecar`."""
    import uvicorn

    cfg = app.config
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    proto = guarded_protocol(cfg.header_timeout_s, cfg.max_header_bytes, cfg.max_connections)
    return uvicorn.Config(app, host=cfg.host, port=cfg.port, loop=loop, http=proto,
                          lifespan="on", log_level="warning", access_log=False, timeout_keep_alive=cfg.keep_alive_s,
                          proxy_headers=False, server_header=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)


#: seconds calls still open at shutdown get to end on their own; then they are cancelled (their
#: client connections and upstream calls closed)
SHUTDOWN_GRACE_S = 5.0
#: seconds after shutdown begins by which the serving process has exited, whatever still runs
#: (:func:`serve_app`: a watchdog ends the process; shutdown can never hang forever)
SHUTDOWN_BOUND_S = SHUTDOWN_GRACE_S + 10.0


def _hard_exit(bound: float) -> None:
    os._exit(1)  # (nothing logged: a stderr nobody reads, full, is one way a process hangs here)


def sidecar_server(app: Any, bound_s: float | None = None, on_overrun: Callable[[float], None] = _hard_exit) -> Any:
    """A uvicorn server for ``app`` that drains the admission queue as soon as shutdown begins
    (uvicorn sends the lifespan shutdown only after its grace period for open calls). With
    ``bound_s``, a daemon watchdog armed by SIGTERM/SIGINT (Python runs the handler even while the
    event loop is blocked) or when shutdown begins calls ``on_overrun(bound_s)`` (by default: exit
    the process at once) unless :meth:`run` has returned by then; a second SIGTERM
    or SIGINT skips the rest of the grace period."""
    import uvicorn

    class SidecarServer(uvicorn.Server):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.finished = threading.Event()
            self.armed = False

        def _arm(self) -> None:
            if bound_s is not None and not self.armed:
                self.armed = True
                done = self.finished
                threading.Thread(target=lambda: done.wait(bound_s) or on_overrun(bound_s),
                                 name="mars-shutdown-watchdog", daemon=True).start()

        def handle_exit(self, sig: int, frame: Any) -> None:
            self._arm()  # here, not only in shutdown: this runs even while the event loop is blocked
            if self.should_exit:
                self.force_exit = True  # (uvicorn forces only on a second SIGINT)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            self._arm()
            app.drain()
            await super().shutdown(sockets)

        def run(self, sockets: Any = None) -> None:
            try:
                super().run(sockets)  # (the event loop's end included: its tasks cancelled, its threads joined)
            finally:
                self.finished.set()

    return SidecarServer(uvicorn_config(app))


def serve_app(app: Any) -> None:
    """Serve ``app`` (a :class:`~vllm_mars.admission.sidecar.app.Sidecar`) until interrupted."""
    cfg = app.config
    logger.warning("mars sidecar on http://%s:%s -> %s (controller %s)", cfg.host, cfg.port,
                   ", ".join(cfg.backends), cfg.controller)
    tune_gc()
    server = sidecar_server(app, SHUTDOWN_BOUND_S)
    log_off_loop()
    server.run()


#: log records waiting for a slow log stream, per logger; beyond, records are dropped
LOG_QUEUE = 10_000


class _Dropping(logging.handlers.QueueHandler):
    """A queue handler that drops a record when the queue is full (never blocks, never writes)."""

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            pass


def log_off_loop() -> None:
    """Writes of log records move to a thread per logger (behind a bounded queue): a log stream
    that stops taking bytes (a stderr pipe nobody reads) then drops records instead of blocking
    the event loop, which froze every call and made the process deaf to SIGTERM. Process-wide:
    the CLI's serving process only, after uvicorn has set up its loggers."""
    for name in (None, "uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        hs = [h for h in lg.handlers if not isinstance(h, logging.handlers.QueueHandler)]
        if not hs:
            continue
        q: queue.Queue = queue.Queue(LOG_QUEUE)
        logging.handlers.QueueListener(q, *hs, respect_handler_level=True).start()  # (a daemon thread)
        lg.handlers = [_Dropping(q)]


#: young objects allowed before a collection (CPython's default 700): a proxied call's messages, frames
#: and futures mostly die by reference count, so fewer collections find less that survives to be rescanned
GC_YOUNG = 10_000


def tune_gc() -> None:
    """Garbage collection for a serving process: what the imports and the app built at start lives as
    long as the process, so it is frozen out of every later collection, and young collections run
    less often. Process-wide, so only the CLI's serving process does it (not a :class:`ServerThread`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])


class ServerThread:
    """An app served on a background thread (tests, notebooks): ``with ServerThread(app) as t: t.url``.
    (This module takes the app; it imports nothing of the sidecar.)"""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.url = f"http://{app.config.host}:{app.config.port}"
        self.server = sidecar_server(self.app)
        self.thread = threading.Thread(target=self.server.run, name="mars-sidecar", daemon=True)

    def start(self, timeout: float = 30.0) -> Self:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("sidecar did not start")
            time.sleep(0.02)
        return self

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the sidecar's event loop and return its result (thread-safe)."""
        loop = self.app._loop
        assert loop is not None

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
