"""A lean HTTP/1.1 client for the sidecar's upstream calls: pooled keep-alive connections on
asyncio protocols, responses parsed by httptools (llhttp, the C parser uvicorn uses).

Why not aiohttp here: the sidecar proxies every streamed chunk, and aiohttp's layers (StreamReader,
multidict headers, per-request URL/timer/tracing objects) cost about as much CPU per chunk as the
backend spends producing it. This client does only what a proxy to vLLM needs: one request at a
time per connection, a body of known length, a response streamed as it arrives, connection reuse
when the server keeps it alive. A streamed body is read either by awaiting :meth:`Response.chunks`, or
pushed: with :meth:`Response.push` set, the connection calls the consumer once per read from the
socket, after the parser has taken the whole read (so whatever one read holds is one chunk; the
sidecar writes it to its client from that callback, with no task wake-up per chunk). Errors are explicit: :class:`UpstreamUnreachable` (the connection
could not be made, so the request provably never reached the server: safe to retry elsewhere) and
:class:`UpstreamBroken` (the request was sent and the connection died, timed out or sent garbage,
before or after the response head: never resent, a POST may have started generating).

Kept-alive connections are reused only while younger than ``idle_ttl_s`` (below the server's own
keep-alive timeout, 5 s in vLLM), so a request is not written into a connection the server is
closing; one found closed before writing is dropped and the next tried.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httptools

#: Bytes buffered from upstream before reading pauses (backpressure from a slow client).
_HIGH_WATER = 1 << 20


class UpstreamUnreachable(Exception):
    """Could not connect: the request was never sent (safe to retry)."""


class UpstreamBroken(Exception):
    """The request was sent, and the response never came, was cut off or was malformed."""


class _Conn(asyncio.Protocol):
    __slots__ = ("_body", "_buffered", "_done", "_error", "_head", "_parser", "_paused", "_sink", "_waiter",
                 "closed", "headers", "idle_since", "keep_alive", "status", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._done = False
        self._error: BaseException | None = None
        self._head: asyncio.Future | None = None
        self._waiter: asyncio.Future | None = None
        #: the push consumer (see :meth:`Response.push`): called after each read instead of a wake-up
        self._sink: Callable[[], None] | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamBroken(f"bad HTTP response: {e}"))
            self.close()
            return
        if self._sink is not None:
            self._sink()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._done:
            where = "mid-response" if self.status else "before the response head"
            self._fail(UpstreamBroken(f"connection closed {where}{': ' + str(exc) if exc else ''}"))

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._sink is not None:
            return  # pushed once the whole read is parsed (data_received)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True  # a slow client: stop reading upstream until it catches up
            self.transport.pause_reading()
        self._wake()

    def _take(self) -> bytes:
        data = b"".join(self._body) if len(self._body) > 1 else self._body[0]
        self._body.clear()
        self._buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def on_message_complete(self) -> None:
        self._done = True
        if self._sink is None:
            self._wake()

    # -- helpers ----------------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        if self._head is not None and not self._head.done():
            self._head.set_exception(err)
            self._head.exception()  # retrieved here; re-raised by the awaiting caller
        self._wake()
        if self._sink is not None:
            self._sink()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """A streaming response: ``status``, ``headers`` (lower-case bytes pairs), ``chunks()``."""

    __slots__ = ("_conn", "_pool", "_released", "headers", "status")

    def __init__(self, conn: _Conn, pool: UpstreamPool) -> None:
        self._conn = conn
        self._pool = pool
        self._released = False
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def chunks(self, read_timeout: float | None = None) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (whatever is buffered is joined into one chunk)."""
        c = self._conn
        loop = asyncio.get_running_loop()
        while True:
            if c._body:
                yield c._take()
                continue
            if c._done:
                return
            if c._error is not None:
                raise c._error
            c._waiter = loop.create_future()
            try:
                if read_timeout is None:
                    await c._waiter
                else:
                    await asyncio.wait_for(c._waiter, read_timeout)
            except TimeoutError:
                raise UpstreamBroken(f"no data for {read_timeout} s") from None
            finally:
                c._waiter = None

    def push(self, sink: Callable[[], None] | None) -> None:
        """Push mode: ``sink()`` is called after every read from the socket that parsed body bytes
        or the end of the response, and when the connection fails (None: back to :meth:`chunks`).
        The sink takes the bytes with :meth:`take` and reads :attr:`done` / :attr:`error`; it must
        not raise. Reading is not paused at a high-water mark in this mode (the sink does not
        buffer): a sink that cannot pass the bytes on calls :meth:`pause_reading`."""
        self._conn._sink = sink

    def take(self) -> bytes:
        """Every body byte received and not yet taken ("" when none)."""
        c = self._conn
        return c._take() if c._body else b""

    @property
    def done(self) -> bool:
        """The whole body has been received (it may not all be taken yet)."""
        return self._conn._done

    @property
    def error(self) -> BaseException | None:
        """Why the response failed (:class:`UpstreamBroken`), or None."""
        return self._conn._error

    def pause_reading(self) -> None:
        c = self._conn
        if not c._paused and c.transport is not None and not c.closed:
            c._paused = True
            c.transport.pause_reading()

    def resume_reading(self) -> None:
        c = self._conn
        if c._paused and c.transport is not None and not c.closed:
            c._paused = False
            c.transport.resume_reading()

    def release(self) -> None:
        """Return the connection to the pool if the response was read fully and may be reused;
        otherwise close it (the server sees the disconnect and aborts its work)."""
        if self._released:
            return
        self._released = True
        c = self._conn
        if c._done and c.keep_alive and not c.closed and c._error is None:
            self._pool._put(c)
        else:
            c.close()

    def close(self) -> None:
        self._released = True
        self._conn.close()


class UpstreamPool:
    """Keep-alive connections to one ``http://host:port`` origin."""

    def __init__(self, base_url: str, *, connect_timeout: float = 5.0, max_idle: int = 256,
                 idle_ttl_s: float = 3.0) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream URL must be http://host[:port], got {base_url!r}")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self.host_header = (u.netloc or self.host).encode()
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle_ttl_s = idle_ttl_s
        self._idle: list[_Conn] = []
        #: connection attempts and requests written (observability and tests)
        self.connects = 0
        self.requests = 0

    def _put(self, c: _Conn) -> None:
        if len(self._idle) < self.max_idle:
            if c._paused:  # (a push consumer paused it for a slow client, then the answer ended)
                c.transport.resume_reading()  # type: ignore[union-attr]  (a paused idle connection never reads the next answer)
            c._reset()
            c.idle_since = time.monotonic()
            self._idle.append(c)
        else:
            c.close()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        self.connects += 1
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, self.host, self.port),
                                             self.connect_timeout)
        except (OSError, TimeoutError) as e:
            raise UpstreamUnreachable(f"cannot connect to {self.host}:{self.port}: {e or type(e).__name__}") from None
        return conn

    async def request(self, method: str, path: str, headers: list[tuple[bytes, bytes]],
                      body: bytes = b"") -> Response:
        """Send one request; returns once the response head has arrived. Raises
        :class:`UpstreamUnreachable` only when no connection could be made (nothing was sent),
        :class:`UpstreamBroken` when the connection failed after the request was written."""
        head = [f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode(), b"host: ", self.host_header, b"\r\n"]
        for k, v in headers:
            head += [k, b": ", v, b"\r\n"]
        head += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        payload = b"".join(head)
        c = None
        now = time.monotonic()
        while self._idle:
            cand = self._idle.pop()
            if not cand.closed and now - cand.idle_since < self.idle_ttl_s:
                c = cand
                break
            cand.close()  # closed by the server, or old enough that the server may be closing it
        if c is None:
            c = await self._connect()
        c._head = asyncio.get_running_loop().create_future()
        assert c.transport is not None
        c.transport.write(payload)
        self.requests += 1
        try:
            await c._head
        except UpstreamBroken:
            c.close()
            raise  # the request went out: resending a POST could run it twice
        except asyncio.CancelledError:
            c.close()
            raise
        return Response(c, self)

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
