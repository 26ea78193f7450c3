"""One proxied call, from the client's body to the backend's answer (the sidecar's data path).

* :func:`read_body`: the request body, bounded in size (413) and in time between chunks (408).
* :func:`parse_call`: JSON object, identity and a body that can be re-encoded (lone surrogates,
  out-of-range numbers in the ``mars_*`` keys: 400, never a 500).
* :class:`Forwarder`: sends an admitted call to its root's backend and answers the client.
  Statuses outside 200-599 from upstream become 502. A non-streaming answer is read whole before
  the client sees its status, so a body cut off upstream is a 502, never a truncated 200. A
  streaming (SSE) answer is passed through chunk by chunk; cut off mid-stream it ends with an SSE
  ``error`` event; a client that takes none of it for ``body_timeout_s`` (its socket full) ends
  the call (:class:`ClientStalled`). A call is resent only when its backend provably never got it (the connection
  could not be made): it then waits up to ``backend_wait_s`` for a live backend.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
import types
from collections.abc import Callable, Mapping
from typing import Any

from vllm_mars.admission.identity import Identity, identify
from vllm_mars.admission.placement import Backend, Placement
from vllm_mars.admission.roots import RootState
from vllm_mars.admission.sidecar.pump import Pump, finish
from vllm_mars.admission.upstream import UpstreamBroken, UpstreamUnreachable
from vllm_mars.workflow import workflow_from_extra_args

logger = logging.getLogger(__name__)

_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"content-encoding",
        b"date", b"server"}
_DROP_UP = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive", b"accept-encoding",
            b"expect", b"upgrade"}
#: the largest token count a client may claim (``mars_prefill_tokens``); larger is a 400
MAX_CLAIMED_TOKENS = 1 << 31
#: the longest workflow / root / parent / tool id accepted (ids are kept per workflow and logged)
MAX_ID_CHARS = 1024
#: the deepest nesting of arrays and objects a request body may have (OpenAI bodies, tool JSON
#: schemas included, stay far below; deeper is a 400 before anything walks the body)
MAX_JSON_DEPTH = 128


def too_deep(raw: bytes, body: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The top-level field of ``body`` nested deeper than ``limit`` arrays/objects (None: none).
    Iterative; a body with fewer brackets than ``limit`` is not walked at all."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return None
    for key, top in body.items():
        stack = [(top, 2)]
        while stack:
            v, depth = stack.pop()
            if isinstance(v, dict):
                v = v.values()
            elif not isinstance(v, list):
                continue
            if depth > limit:
                return key
            stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return None



def _context_hint(payload: bytes) -> bytes:
    """vLLM's "maximum context length" 400, with the flag that raises the limit named in its message."""
    try:
        body = json.loads(payload)
        err = body["error"]
        err["message"] += (" (the server's context length is its --max-model-len: start mars serve, or vLLM, "
                           "with a larger --max-model-len)")
        return json.dumps(body).encode()
    except (ValueError, KeyError, TypeError):
        return payload

class HTTPError(Exception):
    """Answer the client with ``status`` and a JSON error body."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


class ClientStalled(Exception):
    """The client stopped taking the answer (its socket stayed full for ``body_timeout_s``): the
    call ends, its upstream call is closed and its connection should be reset."""


class Unreachable(Exception):
    """The backend could not be reached; nothing was sent to it or to the client."""


_KINDS = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          408: "RequestTimeout", 409: "Conflict", 413: "RequestTooLarge", 502: "BadGateway",
          503: "ServiceUnavailable"}


def err_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": _KINDS.get(status, "Error"), "code": status}}).encode()


async def read_body(scope: dict, receive: Any, limit: int, timeout_s: float, deadline_s: float | None = None,
                    reserve: Callable[[int], None] | None = None) -> bytes:
    """The whole request body; 413 over ``limit`` bytes, 408 when no chunk comes for ``timeout_s``
    or the whole body takes longer than ``deadline_s`` (a slow-loris by body), CancelledError when
    the client disconnects. ``reserve(n)`` is called for each chunk's bytes before it is kept (it
    raises HTTPError when the sidecar's budget for request bodies is spent)."""
    for k, v in scope["headers"]:
        if k == b"content-length":
            try:
                n = int(v)
            except ValueError:
                raise HTTPError(400, "bad Content-Length") from None
            if n > limit:
                raise HTTPError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    end = None if deadline_s is None else loop.time() + deadline_s
    while True:
        wait = timeout_s if end is None else min(timeout_s, end - loop.time())
        try:
            if wait <= 0:
                raise TimeoutError
            co = receive()
            try:  # a chunk already received is returned at once: no timer for it
                fut = co.send(None) if type(co) is types.CoroutineType else None
            except StopIteration as stop:
                msg = stop.value
            else:
                async with asyncio.timeout(wait):  # (a timer on this task: wait_for would start another task)
                    msg = await (co if fut is None else finish(co, fut))
        except TimeoutError:
            if end is not None and loop.time() >= end - 1e-3:
                raise HTTPError(408, f"request body not complete within {deadline_s} s") from None
            raise HTTPError(408, f"request body not received within {timeout_s} s") from None
        if msg["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body exceeds the limit of {limit} bytes")
        if reserve is not None and chunk:
            reserve(len(chunk))
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


#: the most JSON values (an upper bound: commas plus arrays and objects) a body may hold; parsing
#: ``[[],[],...]`` costs ~30x its bytes, so a body's parsed size is bounded and counted before parsing
MAX_JSON_VALUES = 2_000_000
#: bytes charged per JSON value when a body is parsed (a list or dict object plus its reference)
PARSED_BYTES_PER_VALUE = 80


def json_values(raw: bytes) -> int:
    """An upper bound on the values in JSON text ``raw`` (C-speed byte counts)."""
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1


def parse_call(raw: bytes, headers: Mapping[str, str]) -> tuple[dict, Identity]:
    """The JSON body and the call's identity; HTTPError(400) naming the problem."""
    try:
        # decoded strictly (json.loads of bytes lets an encoded lone surrogate through, which then
        # cannot be encoded again): such a body is a 400 here
        enc = ("utf-8-sig" if raw[:3] == b"\xef\xbb\xbf" else "utf-8") if is_utf8(raw) else json.detect_encoding(raw)
        body = json.loads(raw.decode(enc))
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"request body is not valid {e.encoding.upper()}: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HTTPError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"request body must be a JSON object, got {type(body).__name__}")
    if (deep := too_deep(raw, body)) is not None:
        raise HTTPError(400, f"request body field {deep!r} is nested more than {MAX_JSON_DEPTH} arrays/objects "
                             "deep")
    if b"\\ud" in raw or b"\\uD" in raw:  # a \uXXXX surrogate escape: is every one paired?
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            raise HTTPError(400, f"request body has an unpaired UTF-16 surrogate ({e.reason})") from None
    try:
        ident = identify(headers, body)
        xargs = body.get("vllm_xargs")
        if xargs:  # every mars_* key, checked by the engine's own parser: a wrong one is a 400 here,
            workflow_from_extra_args(xargs, "-")  # never a call the engine serves untagged
    except (ValueError, OverflowError, TypeError) as e:
        msg = str(e).replace("extra_args[", "vllm_xargs[") if isinstance(e, ValueError) else \
            f"a mars_* value is out of range: {e}"
        raise HTTPError(400, msg) from None
    for what, v in (("workflow", ident.workflow), ("root", ident.root), ("parent", ident.parent),
                    ("tool", ident.tool)):
        if v is not None and len(v) > MAX_ID_CHARS:
            raise HTTPError(400, f"the {what} id is {len(v)} characters; at most {MAX_ID_CHARS}")
    if ident.prefill_tokens is not None and ident.prefill_tokens > MAX_CLAIMED_TOKENS:
        raise HTTPError(400, f"mars_prefill_tokens = {ident.prefill_tokens}: must be <= {MAX_CLAIMED_TOKENS}")
    if ident.turn is not None and ident.turn > MAX_CLAIMED_TOKENS:
        raise HTTPError(400, f"mars_turn = {ident.turn}: must be <= {MAX_CLAIMED_TOKENS}")
    return body, ident


def is_utf8(raw: bytes) -> bool:
    """Whether JSON text ``raw`` is UTF-8 rather than UTF-16/32 (:func:`json.detect_encoding`'s rule:
    no UTF-16 byte-order mark, no NUL in the first 4 bytes)."""
    return raw[:2] not in (b"\xff\xfe", b"\xfe\xff") and b"\0" not in raw[:4]


def _small_json(v: Any) -> str:
    """JSON text of the few values the sidecar adds (ids, counts, flags; :func:`json.dumps` for
    anything else): cheaper than json.dumps on a dict this small."""
    if type(v) is str:
        return _json_str(v)
    if v is True or v is False or v is None:
        return "true" if v else "false" if v is False else "null"
    if type(v) is int:
        return str(v)
    if type(v) is dict:
        return "{" + ",".join([f"{_json_str(k)}:{_small_json(x)}" for k, x in v.items()]) + "}" \
            if all(type(k) is str for k in v) else json.dumps(v)
    return json.dumps(v)


_json_str = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def forward_bytes(raw: bytes, body: dict, n0: int | None) -> bytes:
    """The JSON to forward for a call whose client sent ``raw``, parsed into ``body``, which had
    ``n0`` keys then and has since only been given new keys (None: a key it had changed). When it
    was so and ``raw`` is UTF-8, the client's own bytes with the new keys written before the
    closing brace (no re-encoding of the whole body: a JSON object's keys may come in any order);
    otherwise all of ``body`` encoded afresh."""
    if n0 is not None and len(body) > n0 and is_utf8(raw):
        end = raw.rstrip(b" \t\n\r")
        if end[-1:] == b"}":
            tail = ",".join([f"{_small_json(k)}:{_small_json(v)}" for k, v in itertools.islice(body.items(), n0, None)])
            return end[:-1] + (b"," if n0 else b"") + tail.encode() + b"}"
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def down_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k not in _HOP]


def upstream_headers(scope: dict, strip_auth: bool, backend_api_key: str | None) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in scope["headers"]
           if k not in _DROP_UP and k != b"content-type" and not (strip_auth and k == b"authorization")]
    if backend_api_key:
        out.append((b"authorization", b"Bearer " + backend_api_key.encode()))
    out.append((b"content-type", b"application/json"))
    return out


class Forwarder:
    """Sends admitted calls upstream (see the module docstring)."""

    def __init__(self, config: Any, placement: Placement, counters: dict[str, int],
                 backend_failed: Callable[[Backend, str], None], end_root: Callable[[str], Any],
                 still_current: Callable[[RootState], bool], up_event: Callable[[], asyncio.Event]) -> None:
        self.config = config
        self.placement = placement
        self.counters = counters
        self._backend_failed = backend_failed
        self._end_root = end_root
        self._still_current = still_current
        self._up_event = up_event

    def _retry_after(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.config.retry_after_s).encode())]

    async def forward_with_wait(self, r: RootState, path: str, body: dict | bytes, headers: list[tuple[bytes, bytes]],
                                send: Any, extra: list[tuple[bytes, bytes]] = (), scan: Any = None) -> bool:
        """Forward; when the root's backend cannot be connected to (nothing was sent), mark it
        down, wait up to ``backend_wait_s`` for a live backend (the root keeps its slot) and retry
        there. True when the answer was a success. ``extra``: response headers added for the client;
        ``scan``: fed every answer chunk (a :class:`~vllm_mars.admission.continuity.ToolCallScan`)."""
        deadline = time.monotonic() + self.config.backend_wait_s
        while True:
            try:
                return await self.forward(r, path, body, headers, send, extra, scan)
            except Unreachable as e:
                b = r.backend
                self._backend_failed(b, str(e))
                left = deadline - time.monotonic()
                if left <= 0 or not self._still_current(r):
                    self._end_root(r.root, rule="backend_failed")
                    raise HTTPError(503, f"backend unreachable: {e}", self._retry_after()) from None
                logger.warning("backend %s unreachable for workflow %s; waiting for a live backend", b.url, r.root)
                try:
                    await asyncio.wait_for(self._up_event().wait(), left)
                except TimeoutError:
                    continue
                self.placement.release(r.root, b)
                r.backend = self.placement.place(r.root)

    async def forward(self, r: RootState, path: str, body: dict | bytes, headers: list[tuple[bytes, bytes]],
                      send: Any, extra: list[tuple[bytes, bytes]] = (), scan: Any = None) -> bool:
        """Send the call (``body``: its JSON, or the dict to encode) to the root's backend and
        answer the client. True on success."""
        b: Backend = r.backend
        data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        try:
            resp = await b.pool.request("POST", path, [*headers, *b.rank_headers] if b.rank_headers else headers, data)
        except UpstreamUnreachable as e:
            raise Unreachable(str(e)) from None
        except UpstreamBroken as e:
            return self._broken(r, b, str(e), started=False)
        if not 200 <= resp.status <= 599:
            resp.close()
            self.counters["upstream_errors"] += 1
            raise HTTPError(502, f"backend {b.url} answered with HTTP status {resp.status}")
        if not (resp.header(b"content-type") or b"").startswith(b"text/event-stream"):
            return await self._whole(r, b, resp, send, extra, scan)
        return await self._stream(r, b, resp, send, extra, scan)

    def _note_tokens(self, r: RootState, tail: bytes) -> None:
        # usage sits at the end of a response (and in the last SSE event with include_usage)
        if b'"total_tokens"' in tail:
            m = _TOTAL_TOKENS.findall(tail)
            if m:
                r.tokens = max(r.tokens, int(m[-1]))
            c = _CACHED_TOKENS.findall(tail)  # vLLM's prompt_tokens_details (--enable-prompt-tokens-details)
            if c:
                r.cached = int(c[-1])

    async def _whole(self, r: RootState, b: Backend, resp: Any, send: Any, extra: Any, scan: Any) -> bool:
        try:
            payload = b"".join([c async for c in resp.chunks(self.config.read_timeout_s)])
        except UpstreamBroken as e:
            resp.close()
            return self._broken(r, b, str(e), started=False)
        resp.release()
        if resp.status == 400 and b"maximum context length is" in payload:
            payload = _context_hint(payload)
        if scan is not None:
            scan.feed(payload)
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": [*down_headers(resp.headers), *extra, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
        self._note_tokens(r, payload[-4096:])
        return resp.status < 400

    async def _stream(self, r: RootState, b: Backend, resp: Any, send: Any, extra: Any, scan: Any) -> bool:
        """Pass an SSE answer through as it arrives: the hot path. Each read from upstream is
        written to the client from the upstream connection's callback
        (:class:`~vllm_mars.admission.sidecar.pump.Pump`), whatever that read holds joined into one
        write; this task sleeps until the answer ends, fails,
        times out or the client stops taking data (then it finishes that write itself)."""
        done = False
        timeout = self.config.read_timeout_s
        loop = asyncio.get_running_loop()
        pump = Pump(resp, send, scan, timeout)
        try:
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [*down_headers(resp.headers), *extra]})
            resp.push(pump)
            try:
                while True:
                    pump.wake = wake = loop.create_future()
                    pump()  # what arrived with the head, or while this task was busy
                    if not wake.done():
                        if timeout is not None:
                            pump.timer = loop.call_later(timeout, pump.expire, loop)
                        try:
                            await wake
                        finally:
                            if pump.timer is not None:
                                pump.timer.cancel()
                                pump.timer = None
                    if pump.failure is not None:
                        raise pump.failure
                    if pump.pending is not None:  # the client is slow: finish the write here, then go on
                        co, fut = pump.pending
                        pump.pending = None
                        try:
                            async with asyncio.timeout(self.config.body_timeout_s):
                                await finish(co, fut)
                        except TimeoutError:
                            raise ClientStalled(f"the client took no data for {self.config.body_timeout_s} s") \
                                from None
                        if pump.ended:
                            break
                        resp.resume_reading()
                        pump.rx = time.monotonic()
                        continue
                    if pump.ended:
                        break
                    if resp.done:
                        await send({"type": "http.response.body", "body": b""})  # the end came on its own
                        break
                    if resp.error is not None:
                        raise resp.error
                    if pump.timed_out:
                        raise UpstreamBroken(f"no data for {timeout} s")
            except UpstreamBroken as e:
                resp.push(None)
                self._broken(r, b, str(e), started=True)
                err = err_body(502, f"backend {b.url} failed mid-stream: {e}")
                await send({"type": "http.response.body", "body": b"data: " + err + b"\n\n", "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return False
            done = True
            self._note_tokens(r, pump.prev[-2048:] + pump.last[-2048:])
            return resp.status < 400
        finally:
            resp.push(None)
            if pump.pending is not None:
                pump.pending[0].close()
            if done:
                resp.release()  # back to the pool
            else:
                resp.close()  # drop the connection: vLLM aborts the request

    def _broken(self, r: RootState, b: Backend, msg: str, *, started: bool) -> bool:
        """The request reached the backend and the answer failed: never resent. The backend counts
        as down until its next good poll, and the root ends (its KV may be gone with the engine;
        its next call queues anew)."""
        self.counters["upstream_errors"] += 1
        logger.warning("backend %s failed %s for workflow %s: %s", b.url,
                       "mid-response" if started else "before answering", r.root, msg)
        self._backend_failed(b, msg)
        self._end_root(r.root, rule="backend_failed")
        if not started:
            raise HTTPError(502, f"backend {b.url} failed: {msg}")
        return False
