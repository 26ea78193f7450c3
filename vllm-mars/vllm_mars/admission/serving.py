"""Serving the sidecar: uvicorn (with uvloop and httptools, as vLLM runs it) behind a connection
guard, :func:`run_sidecar` for the CLI and :class:`SidecarThread` for tests and notebooks.

The guard (a subclass of uvicorn's httptools protocol) bounds what one client can hold:

* ``header_timeout_s``: a request's head (request line and headers) must arrive within this many
  seconds of the connection opening, or of its first byte on a kept-alive connection; otherwise
  408 and the connection is closed (slow-loris, a header line per second);
* ``max_header_bytes``: a head larger than this gets 431 and the connection is closed;
* ``max_connections``: connections beyond this are answered 503 and closed at once.

The body of a request is bounded by the app (``body_timeout_s`` between body chunks -> 408,
``max_body_bytes`` -> 413).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Self

logger = logging.getLogger(__name__)


def _raw_response(status: int, reason: str) -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").encode()


class _HeadTooLarge(Exception):
    """Raised inside the parser's callbacks to stop parsing an oversized request head."""


def guarded_protocol(header_timeout_s: float, max_header_bytes: int, max_connections: int) -> type:
    """uvicorn's httptools protocol with the limits of the module docstring."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = False
        _head_bytes = 0
        _raw_head = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                logger.warning("connection cap (%d) reached: refusing %s", max_connections, self.client)
                self._reject(503, "Service Unavailable")
                return
            self._arm()

        def _arm(self) -> None:
            self._in_head = True
            self._head_bytes = self._raw_head = 0
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            self._in_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _reject(self, status: int, reason: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(_raw_response(status, reason))
                self.transport.close()

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._in_head:
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
            if not self._in_head:  # the next request on a kept-alive connection
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedProtocol


def uvicorn_config(app: Any) -> Any:
    """The uvicorn config for a :class:`~vllm_mars.admission.sidecar.Sidecar`."""
    import uvicorn

    cfg = app.config
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    proto = guarded_protocol(cfg.header_timeout_s, cfg.max_header_bytes, cfg.max_connections)
    return uvicorn.Config(app, host=cfg.host, port=cfg.port, loop=loop, http=proto,
                          lifespan="on", log_level="warning", access_log=False, timeout_keep_alive=30,
                          proxy_headers=False, server_header=False, timeout_graceful_shutdown=5)


def sidecar_server(app: Any) -> Any:
    """A uvicorn server for ``app`` that drains the admission queue as soon as shutdown begins
    (uvicorn sends the lifespan shutdown only after its grace period for open calls)."""
    import uvicorn

    class SidecarServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.drain()
            await super().shutdown(sockets)

    return SidecarServer(uvicorn_config(app))


def run_sidecar(config: Any) -> None:
    """Serve until interrupted (the ``mars sidecar`` command)."""
    from vllm_mars.admission.sidecar import Sidecar

    app = Sidecar(config)
    logger.warning("mars sidecar on http://%s:%s -> %s (controller %s)", config.host, config.port,
                   ", ".join(config.backends), config.controller)
    sidecar_server(app).run()


class SidecarThread:
    """A sidecar on a background thread (tests, notebooks): ``with SidecarThread(cfg) as sc: sc.url``."""

    def __init__(self, config: Any, controller: Any = None) -> None:
        from vllm_mars.admission.sidecar import Sidecar

        self.app = Sidecar(config, controller)
        self.url = f"http://{config.host}:{config.port}"
        self.server = sidecar_server(self.app)
        self.thread = threading.Thread(target=self.server.run, name="mars-sidecar", daemon=True)

    def start(self, timeout: float = 30.0) -> SidecarThread:
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
