"""The per-session measuring proxy: the only address an agent CLI can reach.

It listens on a Unix socket (sandboxed sessions reach it through ``_agent_exec.py``'s loopback
bridge) or on 127.0.0.1 (``--unsandboxed``), forwards each call unchanged to the server (streams
pass through chunk by chunk) and records it: submit / first byte / end times, status, the usage
in the response (chat ``prompt_tokens``/``completion_tokens`` or Responses
``input_tokens``/``output_tokens``, plus ``cached_tokens``), the identity the client sent (its
session headers, ``prompt_cache_key``) and the workflow the sidecar assigned (its
``x-mars-workflow`` response header, when the server is a vllm-mars sidecar).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

#: request headers that carry a frontend's session identity (recorded per call)
IDENTITY_HEADERS = ("session_id", "session-id", "thread-id", "x-codex-parent-thread-id", "x-openai-subagent",
                    "x-session-id", "x-session-affinity", "x-parent-session-id", "x-litellm-session-id",
                    "x-mars-workflow", "user-agent")
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding", "upgrade",
        "expect", "proxy-connection"}
_DOWN_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}
_NUM = {k: re.compile(rb'"' + k.encode() + rb'"\s*:\s*(\d+)')
        for k in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens", "cached_tokens")}
_TAIL = 16384


def usage_from_tail(tail: bytes) -> dict[str, int | None]:
    """Prompt/output/cached tokens from the end of a response (JSON or SSE); None when absent."""

    def last(key: str) -> int | None:
        m = _NUM[key].findall(tail)
        return int(m[-1]) if m else None

    prompt = last("prompt_tokens")
    output = last("completion_tokens")
    if prompt is None:
        prompt, output = last("input_tokens"), last("output_tokens")
    return {"prompt_tokens": prompt, "output_tokens": output, "cached_tokens": last("cached_tokens")}


@dataclass
class CallRecord:
    """One proxied call; times on the runner's clock (seconds)."""

    session: str
    index: int
    path: str
    submit_ts: float
    first_byte_ts: float | None = None
    end_ts: float | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    #: the workflow / root the sidecar assigned (response headers), None from a plain server
    workflow: str | None = None
    root: str | None = None
    #: the identity the client sent
    sent: dict[str, str] = field(default_factory=dict)
    has_tools: bool = False
    stream: bool = False
    error: str | None = None


class SessionProxy:
    """``await start()``, point the CLI at ``base_url`` (TCP) or bind ``unix_path`` into its
    sandbox, ``await close()``. ``on_call(record)`` runs when each call ends."""

    def __init__(self, server: str, session: str, clock: Callable[[], float],
                 on_call: Callable[[CallRecord], None], unix_path: str | None = None) -> None:
        self.server = server.rstrip("/")
        self.session = session
        self.clock = clock
        self.on_call = on_call
        self.unix_path = unix_path
        self.port: int | None = None
        self.calls: list[CallRecord] = []
        self._runner: Any = None
        self._client: Any = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> SessionProxy:
        self._client = aiohttp.ClientSession(auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None, connect=10))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        if self.unix_path is not None:
            site = web.UnixSite(self._runner, self.unix_path)
            await site.start()
        else:
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    async def _handle(self, request: Any) -> Any:
        body = await request.read()
        rec = CallRecord(self.session, len(self.calls), request.path, self.clock())
        self.calls.append(rec)
        lower = {k.lower(): v for k, v in request.headers.items()}
        rec.sent = {h: lower[h] for h in IDENTITY_HEADERS if h in lower}
        if body and request.method == "POST":
            try:
                j = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                j = None
            if isinstance(j, dict):
                if isinstance(j.get("prompt_cache_key"), str):
                    rec.sent["prompt_cache_key"] = j["prompt_cache_key"]
                rec.has_tools = bool(j.get("tools"))
                rec.stream = bool(j.get("stream"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        resp = None
        tail = b""
        try:
            async with self._client.request(request.method, self.server + request.path_qs, headers=headers,
                                            data=body if body else None) as up:
                rec.status = up.status
                rec.workflow = up.headers.get("x-mars-workflow")
                rec.root = up.headers.get("x-mars-root")
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in _DOWN_HOP})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    if rec.first_byte_ts is None:
                        rec.first_byte_ts = self.clock()
                    tail = (tail + chunk)[-_TAIL:]
                    await resp.write(chunk)
                await resp.write_eof()
        except asyncio.CancelledError:
            rec.error = "client disconnected"
            raise
        except Exception as e:  # noqa: BLE001 (recorded; the client sees a 502 or a cut stream)
            rec.error = f"{type(e).__name__}: {e}"[:300]
            if resp is None:
                resp = web.json_response({"error": {"message": f"agent proxy: {rec.error}", "code": 502}},
                                         status=502)
        finally:
            rec.end_ts = self.clock()
            rec.__dict__.update(usage_from_tail(tail))
            try:
                self.on_call(rec)
            except Exception:
                logger.exception("recording call %s of %s failed", rec.index, rec.session)
        return resp

