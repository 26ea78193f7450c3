"""The admission sidecar: an ASGI proxy in front of one or more vLLM OpenAI servers.

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (proxied, streaming
passed through chunk by chunk as it arrives), ``GET /v1/models``, ``POST
/mars/v1/workflows/{id}/finish``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Split by concern: this module is the app (config, routes, auth, lifespan, telemetry polling,
/metrics); :mod:`~vllm_mars.admission.roots` the root lifecycle on an injected clock;
:mod:`~vllm_mars.admission.placement` the backends and where a new root goes;
:mod:`~vllm_mars.admission.proxy` one proxied call; :mod:`~vllm_mars.admission.held` the bound
on waiting calls; :mod:`~vllm_mars.admission.serving` uvicorn and the connection guard.

Admission: the first call of a root workflow waits until the controller admits the root; later
turns and children of an admitted root pass at once (children of a waiting root wait with it).
Plain calls without identity are one-call workflows. The normalised ids go into ``vllm_xargs``
(:mod:`vllm_mars.admission.identity`). Waiting calls are bounded in number and bytes (beyond: 503
with ``Retry-After``) and keep no parsed body (large ones are spilled to a file).

Trust: without ``api_key`` every client is trusted (it can finish any workflow and join any
admitted root); bind to 127.0.0.1. With several API keys, each key is a tenant: workflow ids are
scoped to the key that sent them, so a client can neither finish nor join another key's workflows.

Faults: no live backend -> a new root gets 503 with ``Retry-After`` while roots already queued
keep waiting; a backend that cannot be connected to -> the call waits up to ``backend_wait_s`` for
a live one (it was never sent); a backend that fails after the call was sent -> 502 (never
resent), or an SSE ``error`` event mid-stream, and the root ends; a client that disconnects -> the
upstream request is closed (vLLM aborts it); invalid JSON or ``mars_*`` values -> 400, a body over
``max_body_bytes`` -> 413, a slow body -> 408, unknown route -> 404, wrong method -> 405,
missing/wrong API key -> 401.

Stack, and why: **uvicorn** with uvloop and httptools (the server vLLM itself runs on, so no new
server dependency) serving a small raw ASGI app (five routes need no framework; the per-chunk cost
is one ``send``). Upstream calls go through :mod:`vllm_mars.admission.upstream`, a pooled keep-alive
HTTP/1.1 client on asyncio protocols with **httptools** (llhttp) parsing: in
``benchmark/perf/sidecar_overhead.py`` it cut the sidecar's CPU per proxied streaming request by a
third against aiohttp's client (0.96 -> 0.65 ms for 16 chunks), and the proxy's CPU per chunk is what
limits it. The /metrics polls go through the same pooled client.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from vllm_mars.admission.base import AdmissionController, AdmissionEvent, make_controller
from vllm_mars.admission.continuity import Continuity, ToolCallScan, offers_tools
from vllm_mars.admission.held import HeldBody, QueueBudget, give_back_memory
from vllm_mars.admission.identity import Identity, apply_to_body, estimate_prompt_tokens
from vllm_mars.admission.placement import Backend, Placement, check_placement, pooled_telemetry, prompt_token_ids
from vllm_mars.admission.proxy import (
    MAX_JSON_VALUES,
    PARSED_BYTES_PER_VALUE,
    Forwarder,
    HTTPError,
    down_headers,
    err_body,
    json_values,
    parse_call,
    read_body,
    upstream_headers,
)
from vllm_mars.admission.roots import RootState, RootTable
from vllm_mars.admission.serving import ServerThread, serve_app
from vllm_mars.admission.telemetry import TelemetryState
from vllm_mars.admission.upstream import UpstreamBroken, UpstreamUnreachable
from vllm_mars.clock import Clock, MonotonicClock
from vllm_mars.workflow import safe_id

logger = logging.getLogger(__name__)

__all__ = ["Sidecar", "SidecarConfig", "SidecarThread", "config_dict", "run_sidecar"]

PROXY_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
#: the id may contain "/" (``org/repo-1``), raw or %2F-encoded (ASGI paths arrive percent-decoded)
_FINISH = re.compile(r"^/mars/v1/workflows/(.+)/finish$", re.DOTALL)

#: (lowest, highest) of each numeric option; None: unbounded on that side. Checked by one function.
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "port": (1, 65535),
    "max_body_bytes": (1, None),
    "idle_timeout_s": (0.001, None),
    "failed_idle_timeout_s": (0.0, None),
    "telemetry_interval_s": (0.01, 60.0),
    "telemetry_timeout_s": (0.01, None),
    "telemetry_stale_s": (0.01, None),
    "retry_after_s": (0, 86_400),
    "connect_timeout_s": (0.001, None),
    "read_timeout_s": (0.001, None),
    "backend_wait_s": (0.0, None),
    "kv_target": (0.1, 0.999),
    "max_queued_calls": (1, None),
    "max_queued_bytes": (1, None),
    "spill_bytes": (0, None),
    "header_timeout_s": (0.01, None),
    "body_timeout_s": (0.01, None),
    "max_header_bytes": (1024, None),
    "max_connections": (1, None),
    "body_deadline_s": (0.01, None),
    "keep_alive_s": (0.1, 3600.0),
    "default_max_tokens": (1, None),
}


@dataclass(frozen=True)
class SidecarConfig:
    """Everything the sidecar reads at start (``mars sidecar`` flags map 1:1 onto these)."""

    #: Base URLs of the vLLM OpenAI servers, e.g. ``http://127.0.0.1:8000``.
    backends: tuple[str, ...]
    #: Admission controller: a registered name (``mars``, ``concur``, ``none``).
    controller: str = "mars"
    #: The controller's config fields (see ``MarsAdmissionConfig`` / ``ConcurConfig``).
    controller_options: Mapping[str, Any] = field(default_factory=dict)
    #: Listen address; 127.0.0.1 by default (not exposed to the network unless asked).
    host: str = "127.0.0.1"
    #: Listen port.
    port: int = 8100
    #: If set, clients must send ``Authorization: Bearer <api_key>`` (except on /health).
    api_key: str | None = None
    #: More accepted keys; with two or more keys in all, workflows are scoped to the key that sent them.
    api_keys: tuple[str, ...] = ()
    #: If set, sent upstream as ``Authorization: Bearer <backend_api_key>``; else the client's header passes.
    backend_api_key: str | None = None
    #: Largest accepted request body; larger -> 413.
    max_body_bytes: int = 16 << 20
    #: A workflow with no call for this long ends (seconds).
    idle_timeout_s: float = 600.0
    #: A workflow whose last call failed ends after this long without a call (seconds).
    failed_idle_timeout_s: float = 5.0
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
    #: How long an admitted call waits for a live backend when its own cannot be connected to (s).
    backend_wait_s: float = 300.0
    #: Guard-margin target used to rank backends for new roots (None: the controller's ``kv_target``, else 0.9).
    kv_target: float | None = None
    #: Calls allowed to wait for admission at once; more -> 503 + Retry-After.
    max_queued_calls: int = 1024
    #: Body bytes allowed to wait for admission at once; more -> 503 + Retry-After.
    max_queued_bytes: int = 1 << 30
    #: A waiting call's body larger than this is kept in a file, not in memory.
    spill_bytes: int = 64 << 10
    #: Directory for spilled bodies (None: the system temp directory).
    spill_dir: str | None = None
    #: A request head must arrive within this many seconds (else 408, connection closed).
    header_timeout_s: float = 10.0
    #: Largest request head (bytes; else 431, connection closed).
    max_header_bytes: int = 64 << 10
    #: Longest wait between two chunks of a request body (s; else 408).
    body_timeout_s: float = 30.0
    #: Client connections held at once; at the cap an idle keep-alive connection, else the slowest
    #: request still sending its head or body, makes room; otherwise 503 and closed.
    max_connections: int = 1000
    #: A whole request body must arrive within this many seconds of its head (s; else 408).
    body_deadline_s: float = 60.0
    #: Seconds an idle keep-alive client connection is kept open.
    keep_alive_s: float = 5.0
    #: The output limit a call that sends none gets (chat/completions ``max_tokens``, Responses
    #: ``max_output_tokens``); calls that send a limit keep theirs. None: the server's (context left).
    default_max_tokens: int | None = None
    #: Where a new root goes: ``mars`` (most KV budget + cached prefix), ``round-robin``,
    #: ``session-hash``, ``least-loaded`` (:mod:`~vllm_mars.admission.placement`).
    placement: str = "mars"
    #: KV event streams to follow, one per backend in order (``tcp://HOST:PORT`` of the server's
    #: ``--kv-events-config`` publisher, rank 0); empty: /metrics only.
    kv_events: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("SidecarConfig.backends: give at least one backend URL (--backend)")
        for b in self.backends:
            if not b.startswith(("http://", "https://")):
                raise ValueError(f"SidecarConfig.backends: {b!r} must start with http:// or https://")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"SidecarConfig.backends: duplicate URL in {list(self.backends)}")
        check_placement(self.placement, "SidecarConfig.placement")
        if self.kv_events and len(self.kv_events) != len(self.backends):
            raise ValueError(f"SidecarConfig.kv_events: give one endpoint per backend ({len(self.backends)}), "
                             f"got {len(self.kv_events)}")
        for ep in self.kv_events:
            if not ep.startswith(("tcp://", "ipc://")) or "*" in ep:
                raise ValueError(f"SidecarConfig.kv_events: {ep!r} must be tcp://HOST:PORT or ipc://PATH "
                                 "(the server's address, not a bind wildcard)")
        given = ([] if self.api_key is None else [self.api_key]) + list(self.api_keys)
        for k in given:  # an empty key must not mean "no authentication"
            if not k or any(c.isspace() or not c.isprintable() for c in k):
                raise ValueError("SidecarConfig.api_key: an API key must be non-empty, printable and without "
                                 "spaces")
        b = self.backend_api_key
        if b is not None and (not b or any(c.isspace() or not c.isprintable() for c in b)):
            raise ValueError("SidecarConfig.backend_api_key: must be non-empty, printable and without spaces")
        check_ranges(self, _RANGES)
        check_paths(self.spill_dir, self.events_path)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: no authentication)."""
        return ((self.api_key,) if self.api_key else ()) + tuple(self.api_keys)


def set_default_max_tokens(body: dict, path: str, n: int) -> None:
    """Give a call that sends no output limit ``n`` (Codex sends none); a call's own limit stays."""
    keys = ("max_output_tokens",) if path.endswith("/responses") else ("max_tokens", "max_completion_tokens")
    if all(body.get(k) is None for k in keys):
        body[keys[0]] = n


def check_ranges(obj: Any, ranges: Mapping[str, tuple[float | None, float | None]]) -> None:
    """Range-check the named numeric fields of a config dataclass with the one options validator
    (:func:`vllm_mars.options.check_value`: type, finite, range); ValueError naming the field."""
    from vllm_mars.options import check_value

    types = {f.name: f.type for f in fields(obj)}
    for name, (lo, hi) in ranges.items():
        check_value(f"{type(obj).__name__}.{name}", types[name], getattr(obj, name), minimum=lo, maximum=hi)


def check_paths(spill_dir: str | None, events_path: str | None) -> None:
    """The file options, checked at start (not at the first call that needs them)."""
    if spill_dir is not None:
        if not os.path.isdir(spill_dir):
            raise ValueError(f"SidecarConfig.spill_dir: {spill_dir!r} is not a directory")
        if not os.access(spill_dir, os.W_OK | os.X_OK):
            raise ValueError(f"SidecarConfig.spill_dir: {spill_dir!r} is not writable")
    if events_path is not None:
        if os.path.isdir(events_path):
            raise ValueError(f"SidecarConfig.events_path: {events_path!r} is a directory")
        parent = os.path.dirname(os.path.abspath(events_path))
        if not (os.access(events_path, os.W_OK) if os.path.exists(events_path)
                else os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            raise ValueError(f"SidecarConfig.events_path: cannot write {events_path!r}")



def _id_headers(ident: Identity, tenant: str = "") -> list[tuple[bytes, bytes]]:
    """The ``x-mars-workflow`` and ``x-mars-root`` response headers that tell the client the
    workflow it was assigned: the ids as :func:`~vllm_mars.workflow.safe_id` encodes them, safe in a
    header whatever the client sent, and the form the finish route's path takes. Built before the
    call is forwarded, so nothing about the ids can fail once the engine has run it."""
    n = len(tenant)
    return [(b"x-mars-workflow", safe_id(ident.workflow[n:]).encode("ascii")),
            (b"x-mars-root", safe_id(ident.root[n:]).encode("ascii"))]


def _header_text(v: bytes) -> str:
    """A header value as text: UTF-8 when it is (a unicode id stays itself), else latin-1."""
    try:
        return v.decode()
    except UnicodeDecodeError:
        return v.decode("latin-1")


class Sidecar:
    """The ASGI application (``uvicorn.run(Sidecar(cfg))``); ``clock`` drives the root lifecycle."""

    def __init__(self, config: SidecarConfig, controller: AdmissionController | None = None,
                 clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.controller = controller or make_controller(config.controller, dict(config.controller_options))
        self.backends = [Backend(u, telemetry_timeout_s=config.telemetry_timeout_s,
                                 telemetry_stale_s=config.telemetry_stale_s,
                                 connect_timeout_s=config.connect_timeout_s, clock=self.clock)
                         for u in config.backends]
        self.placement = Placement(self.backends, self.controller, config.kv_target, rule=config.placement)
        self.counters: dict[str, int] = {"requests": 0, "rejected_503": 0, "queue_full_503": 0, "upstream_errors": 0,
                                         "client_disconnects": 0, "event_write_errors": 0}
        self.lifecycle = RootTable(self.controller, self.clock, idle_timeout_s=config.idle_timeout_s,
                                   failed_idle_timeout_s=config.failed_idle_timeout_s,
                                   place=lambda r: self.placement.place(r.root, self._root_tokens.get(r.root)),
                                   on_admit=self._on_admit, on_end=self._on_end, counters=self.counters,
                                   tenant_of=(lambda root: root.partition("/")[0]) if len(set(config.keys)) > 1 else None)
        self.queue_budget = QueueBudget(config.max_queued_calls, config.max_queued_bytes)
        #: prefix continuity of generic session ids (issue 12)
        self.continuity = Continuity()
        self.forwarder = Forwarder(config, self.placement, self.counters, self._backend_failed,
                                   self.lifecycle.finish, lambda r: self.lifecycle.get(r.root) is r,
                                   lambda: self._up_event)
        self._tenants = {k.encode(): hashlib.sha256(k.encode()).hexdigest()[:10] for k in config.keys}
        self.in_flight = 0
        #: shutdown has begun (see :meth:`drain`)
        self.draining = False
        #: the last admission events, newest last (the full stream goes to ``events_path``)
        self.recent_events: deque[AdmissionEvent] = deque(maxlen=1000)
        self._tasks: list[asyncio.Task] = []
        self._events_file: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up_event: asyncio.Event = None  # type: ignore[assignment]  (made on the serving loop)
        self.any_up = False
        self._kv_subs: list[Any] = []
        #: a new root's prompt token ids while it waits for placement (``--kv-events`` only)
        self._root_tokens: dict[str, list[int]] = {}

    @property
    def roots(self) -> dict[str, RootState]:
        return self.lifecycle.roots

    # -- lifecycle --------------------------------------------------------------------------------
    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        if cfg.events_path:
            self._events_file = open(cfg.events_path, "a", buffering=1)  # noqa: SIM115, ASYNC230 (once)
        self._up_event = asyncio.Event()
        await asyncio.gather(*(b.telemetry.poll_upstream(b.pool) for b in self.placement.servers))
        self.backends = self.placement.expand_ranks()  # one backend per data-parallel rank
        if cfg.kv_events:
            self._kv_subs = self.placement.follow_kv_events(cfg.kv_events)
        self._observe()
        self._tasks = [asyncio.create_task(self._ticker(), name="mars-ticker")]
        self._tasks += [asyncio.create_task(self._poller(b), name=f"mars-poll-{b.url}") for b in self.placement.servers]
        logger.info("sidecar up: controller=%s backends=%s", self.controller.name, [b.name for b in self.backends])

    def drain(self) -> None:
        """Shutdown has begun: calls waiting for admission get 503 now (not a cancelled task after
        the server's grace period), and calls still in flight when that period ends are cut quietly."""
        self.draining = True
        for r in self.roots.values():
            w = r.waiter
            if w is not None and not w.done():
                w.set_exception(HTTPError(503, "sidecar shutting down; retry later", self._retry_after()))
                w.exception()  # mark retrieved

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.drain()
        for b in self.placement.servers:
            b.pool.close()
        for sub in self._kv_subs:
            sub.close()
        if self._events_file is not None:
            self._events_file.close()

    # -- control loop -----------------------------------------------------------------------------
    async def _poller(self, b: Backend) -> None:
        while True:
            await asyncio.sleep(self.config.telemetry_interval_s)
            await b.telemetry.poll_upstream(b.pool)
            self._observe()

    def _update_up(self) -> bool:
        ups = [b.refresh() for b in self.backends]  # refresh every backend, no short-circuit
        up = any(ups)
        self.any_up = self.lifecycle.live = up
        if self._up_event is not None:
            if up:
                self._up_event.set()
            else:
                self._up_event.clear()
        return up

    def _observe(self) -> None:
        """Feed the controller the live replicas' summed reading (none live: the controller sees
        its last reading age, which is pressure, never blind admission)."""
        self._update_up()
        tel = pooled_telemetry(self.backends)
        if tel is not None:
            self.controller.observe(tel)

    def _backend_failed(self, b: Backend, msg: str) -> None:
        b.telemetry._fail(msg)  # down until its next good poll
        self._update_up()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.controller.interval_s)
            try:
                self._update_up()  # a backend whose readings stop turns stale even without a failed poll
                self.lifecycle.tick()
                self.lifecycle.expire()
                self.lifecycle.enforce_fair_shares()
                self._flush_events()
            except Exception:  # never let the control loop die
                logger.exception("admission tick failed")

    def _on_admit(self, r: RootState) -> None:
        w = r.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _on_end(self, r: RootState) -> None:
        self.placement.release(r.root, r.backend)
        w = r.waiter
        if w is not None and not w.done():
            w.cancel()
        self._flush_events()

    def _flush_events(self) -> None:
        evs = self.controller.take_events() + self.lifecycle.take_events()
        self.recent_events.extend(evs)
        if evs and self._events_file is not None:
            try:
                for e in evs:
                    self._events_file.write(json.dumps({"ts": e.ts, "event": e.event, **e.data}, default=str) + "\n")
            except OSError as e:  # a full disk (or /dev/full) loses events, never a call or the ticker
                self.counters["event_write_errors"] += 1
                if self.counters["event_write_errors"] == 1:
                    logger.error("cannot write admission events to %s: %s (counted in "
                                 "mars_sidecar_event_write_errors_total; logged once)", self.config.events_path, e)

    # -- ASGI -------------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            tenant = self._check_key(scope) if self._tenants and path != "/health" else ""
            if path in PROXY_ROUTES:
                if method != "POST":
                    raise HTTPError(405, f"{path} takes POST")
                await self._proxy(scope, receive, send, path, tenant)
            elif path == "/v1/models":
                if method != "GET":
                    raise HTTPError(405, f"{path} takes GET")
                await self._models(scope, send)
            elif (m := _FINISH.match(path)) is not None:
                if method != "POST":
                    raise HTTPError(405, f"{path} takes POST")
                ended = self.lifecycle.finish(tenant + m.group(1), rule="finish_route")
                await self._json(send, 200, {"workflow": m.group(1), "ended": ended})
            elif path == "/health":
                up = [b.url for b in self.backends if b.up]
                await self._json(send, 200 if up else 503,
                                 {"status": "ok" if up else "no backend", "backends_up": up})
            elif path == "/metrics":
                await self._send(send, 200, self.metrics_text().encode(),
                                 [(b"content-type", b"text/plain; version=0.0.4")])
            else:
                raise HTTPError(404, f"no route {path}; routes: {', '.join(PROXY_ROUTES)}, /v1/models, "
                                     "/mars/v1/workflows/{id}/finish, /health, /metrics")
        except HTTPError as e:
            await self._send(send, e.status, err_body(e.status, e.message),
                             [(b"content-type", b"application/json"), *e.headers])
        except asyncio.CancelledError:
            if not self.draining:
                raise
            logger.info("call to %s cut at shutdown (still running after the grace period)", path)

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

    def _check_key(self, scope: dict) -> str:
        """The caller's workflow-id scope: '' with one key, ``<key hash>/`` with several; 401 otherwise."""
        for k, v in scope["headers"]:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                got = v[7:].strip()
                for key, tenant in self._tenants.items():
                    if hmac.compare_digest(got, key):
                        return f"{tenant}/" if len(self._tenants) > 1 else ""
        raise HTTPError(401, "missing or wrong API key (Authorization: Bearer <key>)")

    @staticmethod
    async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send: Any, status: int, obj: Any) -> None:
        await self._send(send, status, json.dumps(obj).encode(), [(b"content-type", b"application/json")])

    def _retry_after(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.config.retry_after_s).encode())]

    def _upstream_headers(self, scope: dict) -> list[tuple[bytes, bytes]]:
        cfg = self.config
        return upstream_headers(scope, bool(cfg.keys) or bool(cfg.backend_api_key), cfg.backend_api_key)

    async def _models(self, scope: dict, send: Any) -> None:
        live = [b for b in self.backends if b.up]
        if not live:
            raise HTTPError(503, "no backend is up", self._retry_after())
        resp = None
        try:
            resp = await live[0].pool.request("GET", "/v1/models", self._upstream_headers(scope))
            body = b"".join([c async for c in resp.chunks(self.config.telemetry_timeout_s)])
            resp.release()
        except UpstreamUnreachable as e:
            raise HTTPError(503, f"backend {live[0].url} unreachable: {e}", self._retry_after()) from None
        except UpstreamBroken as e:
            if resp is not None:
                resp.close()
            raise HTTPError(502, f"backend {live[0].url} failed: {e}") from None
        if not 200 <= resp.status <= 599:
            raise HTTPError(502, f"backend {live[0].url} answered with HTTP status {resp.status}")
        await self._send(send, resp.status, body, down_headers(resp.headers))

    # -- the proxied call -------------------------------------------------------------------------
    async def _proxy(self, scope: dict, receive: Any, send: Any, path: str, tenant: str) -> None:
        """Read the body within its bounds (size, gap, deadline), holding its bytes and its parsed
        size in the byte budget from the first chunk until the call ends, then run the call."""
        self.counters["requests"] += 1
        cfg = self.config
        budget = self.queue_budget
        held = 0

        def reserve(n: int) -> None:
            nonlocal held
            if not budget.take_bytes(n):
                self.counters["queue_full_503"] += 1
                raise HTTPError(503, f"admission queue full ({budget.bytes} bytes of request bodies held; limit "
                                     f"{budget.max_bytes} bytes); retry later", self._retry_after())
            held += n

        try:
            try:
                raw = await read_body(scope, receive, cfg.max_body_bytes, cfg.body_timeout_s, cfg.body_deadline_s,
                                      reserve)
            except asyncio.CancelledError:
                self.counters["client_disconnects"] += 1
                return
            values = json_values(raw)
            if values > MAX_JSON_VALUES:
                raise HTTPError(400, f"request body holds more than {MAX_JSON_VALUES} JSON values")
            reserve(values * PARSED_BYTES_PER_VALUE)  # before parsing: what the parsed body will cost
            box = [raw]
            del raw  # (a waiting call keeps no reference to its raw bytes here: _admit spills them)
            await self._call(scope, receive, send, path, tenant, box)
        finally:
            budget.give_bytes(held)

    async def _call(self, scope: dict, receive: Any, send: Any, path: str, tenant: str, box: list) -> None:
        raw = box.pop()
        headers = {k.decode("latin-1"): _header_text(v) for k, v in scope["headers"]}
        body, ident = parse_call(raw, headers)
        call = [body, raw]  # handed to _admit, which drops what a waiting call must not keep
        del body, raw
        if tenant:
            ident = replace(ident, workflow=tenant + ident.workflow, root=tenant + ident.root,
                            parent=None if ident.parent is None else tenant + ident.parent)
        ident, agent, side, est = self._infer(ident, call[0])
        ident = self.lifecycle.sessions.resolve(ident)

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
        r: RootState | None = None
        started = ok = False
        scan = ToolCallScan() if agent and not side and ident.is_root and not ident.anonymous else None
        try:
            if est is not None and (r0 := self.lifecycle.get(ident.root)) is not None:
                self.lifecycle.prompt_seen(r0, est)  # a queued root's footprint from its agent call
            live = next((b for b in self.backends if b.up), None) if self._kv_subs else None
            if live is not None and call[0] is not None and self.lifecycle.get(ident.root) is None:
                toks = await prompt_token_ids(live.pool, path, call[0], self._upstream_headers(scope),
                                              self.config.telemetry_timeout_s)
                if toks:
                    self._root_tokens[ident.root] = toks
            try:
                r = await self._admit(ident, call, est)
            finally:
                self._root_tokens.pop(ident.root, None)
            if est is not None:
                self.lifecycle.prompt_seen(r, est)
            turn = self.lifecycle.call_started(r, ident, agent)
            started = True
            self.in_flight += 1
            body = call[0] if call[0] is not None else json.loads(await call[1].take())
            del call
            apply_to_body(body, ident, turn)
            if self.config.default_max_tokens is not None:
                set_default_max_tokens(body, path, self.config.default_max_tokens)
            ok = await self.forwarder.forward_with_wait(r, path, body, self._upstream_headers(scope), send,
                                                        _id_headers(ident, tenant), scan)
        except asyncio.CancelledError:
            if not disconnected:
                raise
            self.counters["client_disconnects"] += 1
        finally:
            watcher.cancel()
            if started and r is not None:
                self.in_flight -= 1
                self.lifecycle.call_ended(r, ident, ok, final_answer=scan is not None and not scan.saw_tool_call,
                                          finish_tool=scan is not None and scan.finish_called)

    def _infer(self, ident: Identity, body: dict) -> tuple[Identity, bool, bool, int | None]:
        """Prefix continuity of a generic session id (may rename the workflow; events say why),
        and what the call is: (identity, offers tools, side call, prompt estimate)."""
        agent = offers_tools(body)
        ident, verdict = self.continuity.check(ident, body)
        ev = verdict.event()
        if ev is not None:
            self.lifecycle.emit("workflow_continuity", ev)
        side = verdict.kind == "side_call"
        est = None  # only agent calls re-estimate their root's footprint; _admit estimates new roots
        if agent and not side:
            est = ident.prefill_tokens if ident.prefill_tokens is not None else estimate_prompt_tokens(body)
        return ident, agent, side, est

    async def _admit(self, ident: Identity, call: list, est: int | None = None) -> RootState:
        """The admitted root of this call, waiting for admission if needed. ``call`` is
        ``[body, raw]``; a call that waits drops both and leaves ``[None, HeldBody]`` (its raw
        bytes, in a file when large), so a waiting call holds no parsed body."""
        lc = self.lifecycle
        r = lc.get(ident.root)
        if r is not None and r.admitted:
            r.last_activity = self.clock.now()
            return r
        if r is None:
            if not self.any_up:
                self.counters["rejected_503"] += 1
                raise HTTPError(503, "no backend is up; retry later", self._retry_after())
            if est is None:
                est = ident.prefill_tokens if ident.prefill_tokens is not None else estimate_prompt_tokens(call[0])
            r = lc.arrive(ident, est)
            if r.admitted:
                return r
        if r.waiter is None:
            r.waiter = asyncio.get_running_loop().create_future()
        r.waiters += 1
        size = 0  # (its bytes are held in the budget since it was read: see _proxy)
        if not self.queue_budget.take(size):
            lc.left_waiting(r)
            self.counters["queue_full_503"] += 1
            b = self.queue_budget
            raise HTTPError(503, f"admission queue full ({b.calls} calls, {b.bytes} bytes waiting; limits "
                                 f"{b.max_calls} calls, {b.max_bytes} bytes); retry later", self._retry_after())
        held = None
        try:
            raw = call[1]
            call[:] = [None, None]
            held = await HeldBody.hold(raw, self.config.spill_bytes, self.config.spill_dir)
            del raw
            if held.spilled and size >= 1 << 20:
                give_back_memory()
            await asyncio.shield(r.waiter)
            call[1], held = held, None
        except OSError as e:  # (the server's paths stay out of the answer)
            logger.error("cannot spill a waiting request body: %s", e)
            raise HTTPError(503, f"cannot hold the request body while it waits: {e.strerror or type(e).__name__}",
                            self._retry_after()) from None
        except asyncio.CancelledError:
            if r.waiter.cancelled():  # the workflow was ended (finish route) while this call waited
                raise HTTPError(409, f"workflow {ident.root!r} was finished while this call waited") from None
            raise
        finally:
            if held is not None:
                held.discard()
            self.queue_budget.give(size)
            lc.left_waiting(r)
        return r

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
            "# HELP mars_sidecar_waiting_calls Calls waiting for admission (bounded by max_queued_calls).",
            "# TYPE mars_sidecar_waiting_calls gauge",
            f"mars_sidecar_waiting_calls {self.queue_budget.calls}",
            "# TYPE mars_sidecar_waiting_bytes gauge",
            f"mars_sidecar_waiting_bytes {self.queue_budget.bytes}",
        ]
        for k, v in self.counters.items():
            lines += [f"# TYPE mars_sidecar_{k}_total counter", f"mars_sidecar_{k}_total {v}"]
        lines += ["# TYPE mars_backend_up gauge", "# TYPE mars_backend_telemetry_age_seconds gauge",
                  "# TYPE mars_backend_free_blocks gauge", "# TYPE mars_backend_roots gauge",
                  "# TYPE mars_backend_cached_blocks gauge",
                  "# TYPE mars_backend_upstream_requests_total counter"]
        for b in self.backends:
            st = b.telemetry.status()
            lab = f'{{backend="{b.name}"}}'
            age = st.age_s if st.age_s is not None else math.inf
            lines.append(f"mars_backend_up{lab} {int(st.state is TelemetryState.OK)}")
            lines.append(f"mars_backend_telemetry_age_seconds{lab} {age:.3f}")
            fb = st.reading.free_blocks if st.reading is not None else None
            lines.append(f"mars_backend_free_blocks{lab} {fb if fb is not None else 'NaN'}")
            lines.append(f"mars_backend_roots{lab} {len(b.roots)}")
            if b.telemetry.cache is not None:
                lines.append(f"mars_backend_cached_blocks{lab} {len(b.telemetry.cache)}")
            lines.append(f"mars_backend_upstream_requests_total{lab} {b.pool.requests}")
        return "\n".join(lines) + "\n"


def config_dict(cfg: SidecarConfig) -> dict:
    return asdict(cfg)


def run_sidecar(config: SidecarConfig) -> None:
    """Serve until interrupted (the ``mars sidecar`` command)."""
    serve_app(Sidecar(config))


class SidecarThread(ServerThread):
    """A sidecar on a background thread (tests, notebooks): ``with SidecarThread(cfg) as sc: sc.url``."""

    def __init__(self, config: SidecarConfig, controller: AdmissionController | None = None) -> None:
        super().__init__(Sidecar(config, controller))
