"""The admission sidecar: an ASGI proxy in front of one or more vLLM OpenAI servers.

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (proxied, streaming
passed through chunk by chunk as it arrives), ``GET /v1/models``, ``POST
/mars/v1/workflows/{id}/finish``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Admission: the first call of a root workflow waits until the controller admits the root; later
turns and children of an admitted root pass at once (children of a waiting root wait with it). A
workflow ends by the finish route, by a call that carries ``mars_last_step`` (when it completes),
by ``idle_timeout_s`` without calls, or when its backend fails under it (its next call queues
again as a new root, so no work is lost). Plain calls without identity are one-call workflows.
The normalised ids go into ``vllm_xargs`` (:mod:`vllm_mars.admission.identity`).

Several backends: one controller over the pool (telemetry summed over the live replicas); a root
stays on the replica it was admitted to; a new root goes to the replica with the most KV budget
(free blocks above the guard margin, minus the footprints sent there since its last reading).

Faults: no live backend -> a new root gets 503 with ``Retry-After`` while roots already queued
keep waiting (admission pauses until a backend is back); a backend that dies mid-stream -> the
client's SSE stream ends with an ``error`` event and the slot is released; a client that
disconnects -> the upstream request is closed (vLLM aborts it) and the call is accounted as ended;
invalid JSON -> 400, a body over ``max_body_bytes`` -> 413, unknown route -> 404, wrong method ->
405, missing/wrong API key -> 401.

Stack, and why: **uvicorn** with uvloop and httptools (the server vLLM itself runs on, so no new
server dependency) serving a small raw ASGI app (five routes need no framework; the per-chunk cost
is one ``send``). Upstream calls go through :mod:`vllm_mars.admission.upstream`, a pooled keep-alive
HTTP/1.1 client on asyncio protocols with **httptools** (llhttp) parsing: in
``benchmark/perf/sidecar_overhead.py`` it cut the sidecar's CPU per proxied streaming request by a
third against aiohttp's client (0.96 -> 0.65 ms for 16 chunks), and the proxy's CPU per chunk is what
limits it. **aiohttp** (mature, maintained) still does the low-rate /metrics polls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Self

from vllm_mars.admission.base import (
    AdmissionController,
    AdmissionEvent,
    PendingRoot,
    Telemetry,
    make_controller,
)
from vllm_mars.admission.identity import (
    Identity,
    SessionTable,
    apply_to_body,
    estimate_prompt_tokens,
    identify,
)
from vllm_mars.admission.telemetry import HttpTelemetry, TelemetryState
from vllm_mars.admission.upstream import UpstreamBroken, UpstreamPool, UpstreamUnreachable

logger = logging.getLogger(__name__)

PROXY_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_FINISH = re.compile(r"^/mars/v1/workflows/([^/]+)/finish$")
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"content-encoding",
        b"date", b"server"}
_DROP_UP = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive", b"accept-encoding",
            b"expect", b"upgrade"}


@dataclass(frozen=True)
class SidecarConfig:
    """Everything the sidecar reads at start (``mars sidecar`` flags map 1:1 onto these)."""

    #: Base URLs of the vLLM OpenAI servers, e.g. ``http://127.0.0.1:8000``.
    backends: tuple[str, ...]
    #: Admission controller: ``mars``, ``concur`` or ``none``.
    controller: str = "mars"
    #: The controller's config fields (see ``MarsAdmissionConfig`` / ``ConcurConfig``).
    controller_options: Mapping[str, Any] = field(default_factory=dict)
    #: Listen address; 127.0.0.1 by default (not exposed to the network unless asked).
    host: str = "127.0.0.1"
    #: Listen port.
    port: int = 8100
    #: If set, clients must send ``Authorization: Bearer <api_key>`` (except on /health).
    api_key: str | None = None
    #: If set, sent upstream as ``Authorization: Bearer <backend_api_key>``; else the client's header passes.
    backend_api_key: str | None = None
    #: Largest accepted request body; larger -> 413.
    max_body_bytes: int = 16 << 20
    #: A workflow with no call for this long ends (seconds).
    idle_timeout_s: float = 600.0
    #: Seconds between /metrics polls of each backend.
    telemetry_interval_s: float = 0.2
    #: Timeout of one /metrics poll (s).
    telemetry_timeout_s: float = 2.0
    #: A backend whose last good reading is older than this counts as stale (s).
    telemetry_stale_s: float = 2.0
    #: ``Retry-After`` seconds sent with 503.
    retry_after_s: int = 2
    #: Upstream connect timeout (s).
    connect_timeout_s: float = 5.0
    #: Upstream read timeout between chunks (s); None: no limit (long prefills).
    read_timeout_s: float | None = None
    #: Append admission events as JSON lines here (None: keep no log).
    events_path: str | None = None
    #: How long an admitted call waits for a live backend when its own is unreachable (s).
    backend_wait_s: float = 300.0
    #: Guard-margin target used to rank backends for new roots.
    kv_target: float = 0.9

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("SidecarConfig.backends: give at least one backend URL (--backend)")
        for b in self.backends:
            if not b.startswith(("http://", "https://")):
                raise ValueError(f"SidecarConfig.backends: {b!r} must start with http:// or https://")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"SidecarConfig.backends: duplicate URL in {list(self.backends)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"SidecarConfig.port = {self.port}: must be in 1..65535")
        for name in ("max_body_bytes", "idle_timeout_s", "telemetry_interval_s", "telemetry_timeout_s",
                     "telemetry_stale_s", "connect_timeout_s", "backend_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SidecarConfig.{name} = {getattr(self, name)!r}: must be > 0")
        if self.retry_after_s < 0:
            raise ValueError(f"SidecarConfig.retry_after_s = {self.retry_after_s}: must be >= 0")


class _Backend:
    __slots__ = ("assigned", "pool", "roots", "telemetry", "up", "url")

    def __init__(self, url: str, cfg: SidecarConfig) -> None:
        self.url = url.rstrip("/")
        self.telemetry = HttpTelemetry(self.url, timeout_s=cfg.telemetry_timeout_s, stale_s=cfg.telemetry_stale_s)
        self.pool = UpstreamPool(self.url, connect_timeout=cfg.connect_timeout_s)
        self.assigned: list[tuple[float, int]] = []  # (ts, footprint blocks) since the last reading
        self.roots = 0
        self.up = False

    def refresh(self) -> bool:
        """Recompute ``up`` (last poll good and fresh); cached so the hot path reads a bool."""
        self.up = self.telemetry.status().state is TelemetryState.OK
        return self.up

    def score(self, kv_target: float) -> float:
        b = self.telemetry.budget_blocks(kv_target)
        last = self.telemetry.last
        pending = sum(blk for ts, blk in self.assigned if last is None or ts > last.ts)
        return b - pending


class _Root:
    __slots__ = ("admitted", "backend", "blocks", "future", "in_flight", "last_activity", "root", "tokens",
                 "waiters")

    def __init__(self, root: str, now: float, future: asyncio.Future) -> None:
        self.root = root
        self.backend: _Backend | None = None
        self.admitted = False
        self.future = future
        self.waiters = 0
        self.in_flight = 0
        self.last_activity = now
        self.blocks = 0
        #: the largest ``usage.total_tokens`` seen in this workflow's responses (its KV size so far)
        self.tokens = 0


class _Unreachable(Exception):
    """The backend could not be reached; nothing was sent to the client."""


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


def _err_body(status: int, message: str) -> bytes:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
            413: "RequestTooLarge", 502: "BadGateway", 503: "ServiceUnavailable"}.get(status, "Error")
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


class Sidecar:
    """The ASGI application (``uvicorn.run(Sidecar(cfg))``)."""

    def __init__(self, config: SidecarConfig, controller: AdmissionController | None = None) -> None:
        self.config = config
        self.controller = controller or make_controller(config.controller, dict(config.controller_options))
        self.backends = [_Backend(u, config) for u in config.backends]
        self.roots: dict[str, _Root] = {}
        self.sessions = SessionTable()
        self.turns: dict[str, int] = {}
        self.counters: dict[str, int] = {"requests": 0, "rejected_503": 0, "upstream_errors": 0,
                                         "client_disconnects": 0, "finished": 0, "idle_finished": 0}
        self.in_flight = 0
        #: the last admission events, newest last (the full stream goes to ``events_path``)
        self.recent_events: deque[AdmissionEvent] = deque(maxlen=1000)
        self._session: Any = None
        self._tasks: list[asyncio.Task] = []
        self._events_file: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up_event: asyncio.Event | None = None
        self.any_up = False

    # -- lifecycle --------------------------------------------------------------------------------
    async def startup(self) -> None:
        import aiohttp

        self._loop = asyncio.get_running_loop()
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s),
            auto_decompress=False)
        if cfg.events_path:
            self._events_file = open(cfg.events_path, "a", buffering=1)  # noqa: SIM115, ASYNC230 (once)
        self._up_event = asyncio.Event()
        await asyncio.gather(*(b.telemetry.poll_async(self._session) for b in self.backends))
        self._observe()
        self._tasks = [asyncio.create_task(self._ticker(), name="mars-ticker")]
        self._tasks += [asyncio.create_task(self._poller(b), name=f"mars-poll-{b.url}") for b in self.backends]
        logger.info("sidecar up: controller=%s backends=%s", self.controller.name, [b.url for b in self.backends])

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for r in self.roots.values():
            if not r.future.done():
                r.future.set_exception(_HTTPError(503, "sidecar shutting down"))
                r.future.exception()  # mark retrieved
        if self._session is not None:
            await self._session.close()
        for b in self.backends:
            b.pool.close()
        if self._events_file is not None:
            self._events_file.close()

    # -- control loop -----------------------------------------------------------------------------
    async def _poller(self, b: _Backend) -> None:
        while True:
            await asyncio.sleep(self.config.telemetry_interval_s)
            await b.telemetry.poll_async(self._session)
            self._observe()

    def _update_up(self) -> bool:
        ups = [b.refresh() for b in self.backends]  # refresh every backend, no short-circuit
        up = any(ups)
        self.any_up = up
        if self._up_event is not None:
            if up:
                self._up_event.set()
            else:
                self._up_event.clear()
        return up

    def _observe(self) -> None:
        """Sum the live replicas' readings into one Telemetry for the controller."""
        self._update_up()
        live = [b.telemetry.last for b in self.backends if b.up]
        for b in self.backends:
            last = b.telemetry.last
            if last is not None:
                b.assigned = [(ts, blk) for ts, blk in b.assigned if ts > last.ts]
        if not live:
            return  # the controller sees its last reading age: pressure, never blind admission
        tels = [t for t in live if t is not None]
        free = sum(t.free_blocks or 0 for t in tels)
        total = sum(t.total_blocks or 0 for t in tels)
        self.controller.observe(Telemetry(
            ts=min(t.ts for t in tels), free_blocks=free, total_blocks=total,
            block_size=tels[0].block_size, kv_usage=(1 - free / total) if total else None,
            prefix_hit_rate=tels[0].prefix_hit_rate if len(tels) == 1 else None))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.controller.interval_s)
            try:
                self._update_up()  # a backend whose readings stop turns stale even without a failed poll
                self._tick()
                self._expire_idle()
            except Exception:  # never let the control loop die
                logger.exception("admission tick failed")

    def _tick(self) -> None:
        now = time.monotonic()
        if not self.any_up:
            self._flush_events()
            return  # queued roots wait until a backend is back
        for wf in self.controller.tick(now):
            r = self.roots.get(wf)
            if r is None:  # cancelled meanwhile
                self.controller.finish(wf, now)
                continue
            r.admitted = True
            r.backend = self._place(r)
            if not r.future.done():
                r.future.set_result(None)
        self._flush_events()

    def _place(self, r: _Root) -> _Backend:
        live = [b for b in self.backends if b.up] or self.backends
        best = max(live, key=lambda b: (b.score(self.config.kv_target), -b.roots))
        best.roots += 1
        best.assigned.append((time.monotonic(), r.blocks))
        return best

    def _expire_idle(self) -> None:
        now = time.monotonic()
        idle = [r.root for r in self.roots.values()
                if r.admitted and r.in_flight == 0 and now - r.last_activity > self.config.idle_timeout_s]
        for root in idle:
            self.counters["idle_finished"] += 1
            self._finish_root(root)

    def _finish_root(self, root: str, final_tokens: int | None = None) -> bool:
        r = self.roots.pop(root, None)
        if r is None:
            return False
        if r.backend is not None:
            r.backend.roots -= 1
        if not r.future.done():
            r.future.cancel()
        if final_tokens is None and r.tokens:
            final_tokens = r.tokens  # with the root session's call count: how much workflows grow per turn
        self.controller.finish(root, time.monotonic(), final_tokens, turns=self.turns.get(root))
        for session in self.sessions.forget_root(root):
            self.turns.pop(session, None)
        self.counters["finished"] += 1
        self._tick()
        return True

    def _flush_events(self) -> None:
        evs = self.controller.take_events()
        self.recent_events.extend(evs)
        if evs and self._events_file is not None:
            for e in evs:
                self._events_file.write(json.dumps({"ts": e.ts, "event": e.event, **e.data}, default=str) + "\n")

    # -- ASGI -------------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            if self.config.api_key is not None and path != "/health":
                self._check_key(scope)
            if path in PROXY_ROUTES:
                if method != "POST":
                    raise _HTTPError(405, f"{path} takes POST")
                await self._proxy(scope, receive, send, path)
            elif path == "/v1/models":
                if method != "GET":
                    raise _HTTPError(405, f"{path} takes GET")
                await self._models(scope, send)
            elif (m := _FINISH.match(path)) is not None:
                if method != "POST":
                    raise _HTTPError(405, f"{path} takes POST")
                ended = self._finish_route(m.group(1))
                await self._json(send, 200, {"workflow": m.group(1), "ended": ended})
            elif path == "/health":
                up = [b.url for b in self.backends if b.up]
                await self._json(send, 200 if up else 503,
                                 {"status": "ok" if up else "no backend", "backends_up": up})
            elif path == "/metrics":
                await self._send(send, 200, self.metrics_text().encode(),
                                 [(b"content-type", b"text/plain; version=0.0.4")])
            else:
                raise _HTTPError(404, f"no route {path}; routes: {', '.join(PROXY_ROUTES)}, /v1/models, "
                                      "/mars/v1/workflows/{id}/finish, /health, /metrics")
        except _HTTPError as e:
            await self._send(send, e.status, _err_body(e.status, e.message),
                             [(b"content-type", b"application/json"), *e.headers])

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:  # noqa: BLE001 (reported to the server, which exits)
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _check_key(self, scope: dict) -> None:
        want = b"bearer " + self.config.api_key.encode()  # type: ignore[union-attr]
        for k, v in scope["headers"]:
            if k == b"authorization" and v.lower() == want.lower() and v[7:] == want[7:]:
                return
        raise _HTTPError(401, "missing or wrong API key (Authorization: Bearer <key>)")

    @staticmethod
    async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send: Any, status: int, obj: Any) -> None:
        await self._send(send, status, json.dumps(obj).encode(), [(b"content-type", b"application/json")])

    def _finish_route(self, wf: str) -> bool:
        if wf in self.roots:
            return self._finish_root(wf)
        return False

    async def _models(self, scope: dict, send: Any) -> None:
        live = [b for b in self.backends if b.up]
        retry = [(b"retry-after", str(self.config.retry_after_s).encode())]
        if not live:
            raise _HTTPError(503, "no backend is up", retry)
        resp = None
        try:
            resp = await live[0].pool.request("GET", "/v1/models", self._upstream_headers(scope))
            body = b"".join([c async for c in resp.chunks(self.config.telemetry_timeout_s)])
            resp.release()
        except UpstreamUnreachable as e:
            raise _HTTPError(503, f"backend {live[0].url} unreachable: {e}", retry) from None
        except UpstreamBroken as e:
            if resp is not None:
                resp.close()
            raise _HTTPError(502, f"backend {live[0].url} failed: {e}") from None
        await self._send(send, resp.status, body, self._down_headers(resp.headers))

    async def _read_body(self, scope: dict, receive: Any) -> bytes:
        limit = self.config.max_body_bytes
        for k, v in scope["headers"]:
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    raise _HTTPError(400, "bad Content-Length") from None
                if n > limit:
                    raise _HTTPError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _HTTPError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    def _upstream_headers(self, scope: dict) -> list[tuple[bytes, bytes]]:
        cfg = self.config
        strip_auth = cfg.api_key is not None or bool(cfg.backend_api_key)
        out = [(k, v) for k, v in scope["headers"]
               if k not in _DROP_UP and k != b"content-type" and not (strip_auth and k == b"authorization")]
        if cfg.backend_api_key:
            out.append((b"authorization", b"Bearer " + cfg.backend_api_key.encode()))
        out.append((b"content-type", b"application/json"))
        return out

    @staticmethod
    def _down_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in headers if k not in _HOP]

    # -- the proxied call -------------------------------------------------------------------------
    async def _proxy(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        self.counters["requests"] += 1
        try:
            raw = await self._read_body(scope, receive)
        except asyncio.CancelledError:
            self.counters["client_disconnects"] += 1
            return
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _HTTPError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _HTTPError(400, f"request body must be a JSON object, got {type(body).__name__}")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            ident = self.sessions.resolve(identify(headers, body))
        except ValueError as e:
            raise _HTTPError(400, str(e)) from None

        task = asyncio.current_task()
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    disconnected = True
                    task.cancel()  # type: ignore[union-attr]
                    return

        watcher = asyncio.create_task(watch())
        r: _Root | None = None
        counted = False
        try:
            r = await self._admit(ident, body)
            r.in_flight += 1
            self.in_flight += 1
            counted = True
            turn = self.turns.get(ident.workflow, 0)
            self.turns[ident.workflow] = turn + 1
            apply_to_body(body, ident, turn)
            ok = await self._forward_with_wait(r, path, body, scope, send)
            if ok and (ident.last_step and ident.workflow == ident.root):
                self._finish_root(ident.root)
        except asyncio.CancelledError:
            if not disconnected:
                raise
            self.counters["client_disconnects"] += 1
            if r is not None and ident.last_step and ident.workflow == ident.root:
                self._finish_root(ident.root)
        finally:
            watcher.cancel()
            if counted and r is not None:
                r.in_flight -= 1
                self.in_flight -= 1
                r.last_activity = time.monotonic()
            if ident.anonymous:  # a one-call workflow ends with its call, however the call ended
                self.turns.pop(ident.workflow, None)
                if self.roots.get(ident.root) is r and r is not None:
                    self._finish_root(ident.root)

    async def _admit(self, ident: Identity, body: dict) -> _Root:
        """Return the admitted root state for this call, waiting for admission if needed."""
        r = self.roots.get(ident.root)
        if r is not None and r.admitted:
            r.last_activity = time.monotonic()
            return r
        if r is None:
            if not self.any_up:
                self.counters["rejected_503"] += 1
                raise _HTTPError(503, "no backend is up; retry later",
                                 [(b"retry-after", str(self.config.retry_after_s).encode())])
            now = time.monotonic()
            r = _Root(ident.root, now, asyncio.get_running_loop().create_future())
            self.roots[ident.root] = r
            est = ident.prefill_tokens if ident.prefill_tokens is not None else estimate_prompt_tokens(body)
            self.controller.offer(PendingRoot(ident.root, now, est, {"source": ident.source}))
            fp = getattr(self.controller, "footprint_blocks", None)
            r.blocks = fp(PendingRoot(ident.root, now, est)) if fp else 0
            self._tick()
            if r.admitted:
                return r
        r.waiters += 1
        try:
            await asyncio.shield(r.future)
        except asyncio.CancelledError:
            if r.future.cancelled():  # the workflow was ended (finish route) while this call waited
                raise _HTTPError(409, f"workflow {ident.root!r} was finished while this call waited") from None
            raise
        finally:
            r.waiters -= 1
            if not r.admitted and r.waiters == 0 and self.roots.get(ident.root) is r:
                # the last waiter left before admission: cancel the root
                del self.roots[ident.root]
                self.controller.finish(ident.root, time.monotonic())
                self._tick()
        return r

    async def _forward_with_wait(self, r: _Root, path: str, body: dict, scope: dict, send: Any) -> bool:
        """Forward; when the root's backend cannot be reached (nothing sent yet), mark it down, wait
        up to ``backend_wait_s`` for a live backend (the root keeps its slot) and retry there."""
        deadline = time.monotonic() + self.config.backend_wait_s
        while True:
            try:
                return await self._forward(r, path, body, scope, send)
            except _Unreachable as e:
                assert r.backend is not None
                r.backend.telemetry._fail(e)  # down until its next good poll
                self._update_up()
                left = deadline - time.monotonic()
                if left <= 0 or self.roots.get(r.root) is not r:
                    self._finish_root(r.root)
                    raise _HTTPError(503, f"backend unreachable: {e}",
                                     [(b"retry-after", str(self.config.retry_after_s).encode())]) from None
                logger.warning("backend %s unreachable for workflow %s; waiting for a live backend",
                               r.backend.url, r.root)
                try:
                    await asyncio.wait_for(self._up_event.wait(), left)
                except TimeoutError:
                    continue
                r.backend.roots -= 1
                r.backend = self._place(r)

    async def _forward(self, r: _Root, path: str, body: dict, scope: dict, send: Any) -> bool:
        """Send the call to the root's backend and stream the answer back. True on success."""
        b = r.backend
        assert b is not None
        try:
            data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
            resp = await b.pool.request("POST", path, self._upstream_headers(scope), data)
        except UpstreamUnreachable as e:
            raise _Unreachable(str(e)) from None
        started = done = False
        sse = (resp.header(b"content-type") or b"").startswith(b"text/event-stream")
        try:
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": self._down_headers(resp.headers)})
            started = True
            prev = last = b""
            async for chunk in resp.chunks(self.config.read_timeout_s):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                prev, last = last, chunk
            await send({"type": "http.response.body", "body": b""})
            done = True
            # usage sits at the end of a response (and in the last SSE event with include_usage)
            tail = prev[-2048:] + last[-2048:]
            if b'"total_tokens"' in tail:
                m = _TOTAL_TOKENS.findall(tail)
                if m:
                    r.tokens = max(r.tokens, int(m[-1]))
            return resp.status < 400
        except UpstreamBroken as e:
            self.counters["upstream_errors"] += 1
            msg = str(e)
            logger.warning("backend %s failed mid-response for workflow %s: %s", b.url, r.root, msg)
            b.telemetry._fail(msg)
            self._update_up()
            self._finish_root(r.root)  # its KV is gone with the engine; the next call queues anew
            if not started:
                raise _HTTPError(502, f"backend {b.url} failed: {msg}") from None
            if sse:
                err = _err_body(502, f"backend {b.url} failed mid-stream: {msg}")
                await send({"type": "http.response.body", "body": b"data: " + err + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return False
        finally:
            if done:
                resp.release()  # back to the pool
            else:
                resp.close()  # drop the connection: vLLM aborts the request

    # -- observability ----------------------------------------------------------------------------
    def metrics_text(self) -> str:
        c = self.controller
        snap = c.snapshot() if hasattr(c, "snapshot") else {}
        lines = [
            "# HELP mars_admission_window Current AIMD window (active-root target).",
            "# TYPE mars_admission_window gauge",
            f"mars_admission_window {snap.get('window', -1)}",
            "# TYPE mars_admission_limit gauge",
            f"mars_admission_limit {snap.get('limit', -1)}",
            "# HELP mars_admission_active Admitted root workflows.",
            "# TYPE mars_admission_active gauge",
            f"mars_admission_active {c.num_active}",
            "# HELP mars_admission_queued Root workflows waiting for admission.",
            "# TYPE mars_admission_queued gauge",
            f"mars_admission_queued {c.num_queued}",
            "# TYPE mars_admission_admitted_total counter",
            f"mars_admission_admitted_total {getattr(c, 'num_admitted', 0)}",
            "# TYPE mars_sidecar_in_flight gauge",
            f"mars_sidecar_in_flight {self.in_flight}",
        ]
        for k, v in self.counters.items():
            lines += [f"# TYPE mars_sidecar_{k}_total counter", f"mars_sidecar_{k}_total {v}"]
        lines += ["# TYPE mars_backend_up gauge", "# TYPE mars_backend_telemetry_age_seconds gauge",
                  "# TYPE mars_backend_free_blocks gauge", "# TYPE mars_backend_roots gauge"]
        for b in self.backends:
            st = b.telemetry.status()
            lab = f'{{backend="{b.url}"}}'
            age = st.age_s if st.age_s is not None else math.inf
            lines.append(f"mars_backend_up{lab} {int(st.state is TelemetryState.OK)}")
            lines.append(f"mars_backend_telemetry_age_seconds{lab} {age:.3f}")
            fb = st.reading.free_blocks if st.reading is not None else None
            lines.append(f"mars_backend_free_blocks{lab} {fb if fb is not None else 'NaN'}")
            lines.append(f"mars_backend_roots{lab} {b.roots}")
        return "\n".join(lines) + "\n"


# -- running it ---------------------------------------------------------------------------------
def _uvicorn_config(app: Sidecar) -> Any:
    import uvicorn

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    return uvicorn.Config(app, host=app.config.host, port=app.config.port, loop=loop, http="httptools",
                          lifespan="on", log_level="warning", access_log=False, timeout_keep_alive=30,
                          proxy_headers=False, server_header=False)


def run_sidecar(config: SidecarConfig) -> None:
    """Serve until interrupted (the ``mars sidecar`` command)."""
    import uvicorn

    app = Sidecar(config)
    logger.warning("mars sidecar on http://%s:%s -> %s (controller %s)", config.host, config.port,
                   ", ".join(config.backends), config.controller)
    uvicorn.Server(_uvicorn_config(app)).run()


class SidecarThread:
    """A sidecar on a background thread (tests, notebooks): ``with SidecarThread(cfg) as sc: sc.url``."""

    def __init__(self, config: SidecarConfig, controller: AdmissionController | None = None) -> None:
        import uvicorn

        self.app = Sidecar(config, controller)
        self.url = f"http://{config.host}:{config.port}"
        self.server = uvicorn.Server(_uvicorn_config(self.app))
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


def config_dict(cfg: SidecarConfig) -> dict:
    return asdict(cfg)
