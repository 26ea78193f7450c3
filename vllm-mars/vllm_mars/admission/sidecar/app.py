"""The admission sidecar's routes: an ASGI proxy in front of one or more vLLM OpenAI servers.

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (proxied, streaming
passed through chunk by chunk as it arrives), ``GET /v1/models``, ``POST
/mars/v1/workflows/{id}/finish``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Split by concern: this module is the routes (auth, the proxied call, /v1/models, the finish route,
/health, /metrics, lifespan); :mod:`~vllm_mars.admission.sidecar.state` the admission state
(controller, backends, control loop, waiting calls, events, metrics text);
:mod:`~vllm_mars.admission.sidecar.config` the config; :mod:`~vllm_mars.admission.roots` the root
lifecycle on an injected clock; :mod:`~vllm_mars.admission.placement` the backends and where a new
root goes; :mod:`~vllm_mars.admission.sidecar.proxy` one proxied call;
:mod:`~vllm_mars.admission.sidecar.held` the bound on waiting calls;
:mod:`~vllm_mars.admission.sidecar.serving` uvicorn and the connection guard.

The normalised ids go into ``vllm_xargs`` (:mod:`vllm_mars.admission.identity`).

Trust: without ``api_key`` every client is trusted (it can finish any workflow and join any
admitted root); bind to 127.0.0.1. With several API keys, each key is a tenant: workflow ids are
scoped to the key that sent them, so a client can neither finish nor join another key's workflows.

Faults: no live backend -> a new root gets 503 with ``Retry-After`` while roots already queued
keep waiting; a backend that cannot be connected to -> the call waits up to ``backend_wait_s`` for
a live one (it was never sent); a backend that fails after the call was sent -> 502 (never
resent), or an SSE ``error`` event mid-stream, and the root ends; a client that disconnects -> the
upstream request is closed (vLLM aborts it), as when it takes no bytes of a streamed answer for
``body_timeout_s`` (then its connection is reset); invalid JSON or ``mars_*`` values -> 400, a body over
``max_body_bytes`` -> 413, a slow body -> 408, unknown route -> 404, wrong method -> 405,
missing/wrong API key -> 401.

Stack, and why: **uvicorn** with uvloop and httptools (the server vLLM itself runs on, so no new
server dependency) serving a small raw ASGI app (five routes need no framework). A streamed answer is written to the
client from the upstream connection's callback, one ``send`` per upstream read and no task wake-up
(:mod:`~vllm_mars.admission.sidecar.pump`); the client's body bytes go upstream with the ids
appended, not re-encoded. Upstream calls go through :mod:`vllm_mars.admission.upstream`, a pooled keep-alive
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
import re
from dataclasses import replace
from typing import Any

from vllm_mars.admission.base import AdmissionController
from vllm_mars.admission.continuity import ToolCallScan
from vllm_mars.admission.identity import Identity, apply_to_body
from vllm_mars.admission.placement import prompt_token_ids
from vllm_mars.admission.roots import RootState
from vllm_mars.admission.sidecar.config import SidecarConfig
from vllm_mars.admission.sidecar.proxy import (
    MAX_JSON_VALUES,
    PARSED_BYTES_PER_VALUE,
    ClientStalled,
    Forwarder,
    HTTPError,
    down_headers,
    err_body,
    forward_bytes,
    json_values,
    parse_call,
    read_body,
    upstream_headers,
)
from vllm_mars.admission.sidecar.serving import ABORT, ON_DISCONNECT, ServerThread, serve_app
from vllm_mars.admission.sidecar.state import SidecarState
from vllm_mars.admission.upstream import UpstreamBroken, UpstreamUnreachable
from vllm_mars.clock import Clock
from vllm_mars.workflow import safe_id

logger = logging.getLogger(__name__)

PROXY_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
#: the id may contain "/" (``org/repo-1``), raw or %2F-encoded (ASGI paths arrive percent-decoded)
_FINISH = re.compile(r"^/mars/v1/workflows/(.+)/finish$", re.DOTALL)


def set_default_max_tokens(body: dict, path: str, n: int) -> bool:
    """Give a call that sends no output limit ``n`` (Codex sends none); a call's own limit stays.
    True when the limit was set."""
    keys = ("max_output_tokens",) if path.endswith("/responses") else ("max_tokens", "max_completion_tokens")
    if all(body.get(k) is None for k in keys):
        body[keys[0]] = n
        return True
    return False


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


class Sidecar(SidecarState):
    """The ASGI application (``uvicorn.run(Sidecar(cfg))``): the routes over the admission state."""

    def __init__(self, config: SidecarConfig, controller: AdmissionController | None = None,
                 clock: Clock | None = None) -> None:
        super().__init__(config, controller, clock)
        self.forwarder = Forwarder(config, self.placement, self.counters, self._backend_failed,
                                   self.lifecycle.finish, lambda r: self.lifecycle.get(r.root) is r,
                                   lambda: self._up_event)
        self._tenants = {k.encode(): hashlib.sha256(k.encode()).hexdigest()[:10] for k in config.keys}

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

        def gone() -> None:
            nonlocal disconnected
            disconnected = True
            task.cancel()  # type: ignore[union-attr]

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone()
                    return

        watcher = None
        if ON_DISCONNECT in scope:  # served by the connection guard: it calls gone() itself
            scope[ON_DISCONNECT] = gone
        else:
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
            if call[0] is not None:
                body, raw = call
            else:
                raw = await call[1].take()
                body = json.loads(raw)
            del call
            n0 = None if "vllm_xargs" in body else len(body)  # (None: a key the client sent changes)
            apply_to_body(body, ident, turn)
            if self.config.default_max_tokens is not None:
                n1 = len(body)
                if set_default_max_tokens(body, path, self.config.default_max_tokens) and len(body) == n1:
                    n0 = None  # the client's null limit was replaced
            data = forward_bytes(raw, body, n0)
            del raw, body
            ok = await self.forwarder.forward_with_wait(r, path, data, self._upstream_headers(scope), send,
                                                        _id_headers(ident, tenant), scan)
        except asyncio.CancelledError:
            if not disconnected:
                raise
            self.counters["client_disconnects"] += 1
        except ClientStalled as e:
            logger.info("call from %s cut: %s", scope.get("client"), e)
            self.counters["client_disconnects"] += 1
            if (abort := scope.get(ABORT)) is not None:
                abort()  # reset: a graceful close would wait for the client to take what is buffered
        finally:
            if watcher is None:
                scope[ON_DISCONNECT] = None
            else:
                watcher.cancel()
            if started and r is not None:
                self.in_flight -= 1
                self.lifecycle.call_ended(r, ident, ok, final_answer=scan is not None and not scan.saw_tool_call,
                                          finish_tool=scan is not None and scan.finish_called)



def run_sidecar(config: SidecarConfig) -> None:
    """Serve until interrupted (the ``mars sidecar`` command)."""
    serve_app(Sidecar(config))


class SidecarThread(ServerThread):
    """A sidecar on a background thread (tests, notebooks): ``with SidecarThread(cfg) as sc: sc.url``."""

    def __init__(self, config: SidecarConfig, controller: AdmissionController | None = None) -> None:
        super().__init__(Sidecar(config, controller))
