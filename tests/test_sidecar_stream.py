"""Issue 35 item 5: the sidecar's streaming hot path. Each read from upstream is written to the
client from the upstream connection's callback (no task wake-up per chunk); a client too slow to
take the bytes has its write finished by the call's task while upstream reading pauses; the read
timeout, an upstream cut mid-stream and a client that hangs up still end the call cleanly, as do
a client that stops reading (paused upstream reading never leaks into the connection pool) and a
SIGTERM with a call stuck upstream (shutdown is bounded). The real
sidecar on 127.0.0.1 in front of a real TCP server that streams SSE as vLLM does (chunked); every
test ends with the leak check."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port
from faulty_backend import METRICS, LoopServer
from polling import wait_until
from test_sidecar import CHAT
from vllm_mars.admission.placement import Backend, Placement
from vllm_mars.admission.sidecar import Sidecar, SidecarConfig, serving
from vllm_mars.admission.sidecar.proxy import forward_bytes
from vllm_mars.admission.sidecar.serving import ServerThread
from vllm_mars.admission.upstream import _Conn


def event(i: int, size: int) -> bytes:
    head = b'data: {"i":%d,"pad":"' % i
    return head + b"x" * max(0, size - len(head) - 5) + b'"}\n\n'


DONE = b"data: [DONE]\n\n"


def frame(b: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(b), b)


class SSEBackend(LoopServer):
    """Streams ``n`` SSE events per POST, as its ``x-stream: n,gap_ms,size,end`` header says: one
    write per event, ``gap_ms`` apart; ``end`` = ``done`` (the last event, ``[DONE]`` and the
    terminating chunk in one write), ``stall`` (then silence until the caller hangs up) or
    ``close`` (then the connection closes mid-stream). Counts connections and hang-ups seen."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.connections = 0
        self.hangups = 0
        #: stalled answers whose caller hung up
        self.stalls_dropped = 0
        #: the body of each POST received
        self.bodies: list[bytes] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method = lines[0].split(" ")[0]
                hdrs = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                body = await reader.readexactly(int(hdrs.get("content-length", "0")))
                if method == "GET":
                    body = METRICS.encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
                    await writer.drain()
                    continue
                self.bodies.append(body)
                n, gap, size, end = hdrs.get("x-stream", "1,0,50,done").split(",")
                n, gap, size = int(n), float(gap) / 1000, int(size)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(n):
                    if gap:
                        await asyncio.sleep(gap)
                    last = i == n - 1 and end == "done"
                    writer.write(frame(event(i, size)) + (frame(DONE) + b"0\r\n\r\n" if last else b""))
                    await writer.drain()
                if end == "stall":
                    await reader.read()
                    self.hangups += 1
                    self.stalls_dropped += 1
                    break
                if end == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hangups += 1
        finally:
            self._writers.discard(writer)
            writer.close()


class Recording:
    """The sidecar app with its body ``send`` calls recorded: (bytes, begun inside a task, ended
    inside a task). A write begun outside any task ran in the upstream connection's callback."""

    def __init__(self, app: Sidecar) -> None:
        self.app = app
        self.config = app.config
        self.sends: list[tuple[int, bool, bool]] = []

    def __getattr__(self, name: str):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def rec(msg):
            begun = asyncio.current_task() is not None
            await send(msg)
            if msg["type"] == "http.response.body":
                self.sends.append((len(msg.get("body", b"")), begun, asyncio.current_task() is not None))

        return await self.app(scope, receive, rec)


@pytest.fixture(scope="module")
def backend():
    with SSEBackend(free_port()) as b:
        yield b


def serve(backend: SSEBackend, **kw) -> ServerThread:
    kw.setdefault("telemetry_interval_s", 0.05)
    cfg = SidecarConfig(backends=(backend.url,), controller="none", port=free_port(), **kw)
    return ServerThread(Recording(Sidecar(cfg)))


def assert_no_leak(sc: ServerThread) -> None:
    app = sc.app.app
    assert wait_until(lambda: app.in_flight == 0, 5), app.in_flight
    assert not app.roots and app.queue_budget.calls == 0 and app.queue_budget.bytes == 0
    assert all(not b.roots for b in app.backends)


def expected(n: int, size: int) -> bytes:
    return b"".join(event(i, size) for i in range(n)) + DONE


def stream(sc: ServerThread, spec: str) -> tuple[int, bytes]:
    with httpx.Client(timeout=30) as c, c.stream("POST", sc.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                                                  headers={"x-stream": spec}) as r:
        return r.status_code, b"".join(r.iter_raw())


def dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = data.index(b"\r\n", i)
        n = int(data[i:j], 16)
        if n == 0:
            return b"".join(out)
        out.append(data[j + 2:j + 2 + n])
        i = j + 2 + n + 2


def test_each_upstream_read_is_written_from_the_callback_with_exact_framing(backend):
    """16 events 20 ms apart: the client gets the backend's bytes exactly, one write per upstream
    read, and (all but at most the first) written from the upstream callback, not by a task."""
    with serve(backend) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        status, body = stream(sc, "16,20,120,done")
        assert status == 200
        assert body == expected(16, 120)
        sends = [s for s in sc.app.sends if s[0]]
        assert len(sends) == 16, sends  # the last event, [DONE] and the end arrive in one read: one write
        outside = sum(1 for _, begun, _ in sends if not begun)
        assert outside >= 15, sc.app.sends
        assert_no_leak(sc)
        # the upstream connection went back to the pool: a second call reuses it
        conns = backend.connections
        assert stream(sc, "3,0,50,done") == (200, expected(3, 50))
        assert backend.connections == conns


def test_slow_client_write_is_finished_by_the_task_while_upstream_pauses(backend):
    """8 MiB streamed to a client that first reads nothing: the sidecar's socket (up to 4 MiB of
    kernel buffer on Linux) fills, the write
    that cannot complete is finished by the call's task (upstream reading paused meanwhile), and
    every byte arrives in order."""
    n, size = 64, 128 << 10
    with serve(backend) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        body = json.dumps({**CHAT, "stream": True}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", sc.app.config.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                  b"content-type: application/json\r\nx-stream: %d,0,%d,done\r\ncontent-length: %d\r\n\r\n%s"
                  % (n, size, len(body), body))
        time.sleep(1.0)  # not reading: the sidecar's writes back up
        got = []
        s.settimeout(30)
        while chunk := s.recv(1 << 20):
            got.append(chunk)
        s.close()
        raw = b"".join(got)
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
        assert dechunk(rest) == expected(n, size)
        assert any(begun is False and ended is True for _, begun, ended in sc.app.sends), \
            "no write had to wait for the client"
        assert_no_leak(sc)


def test_read_timeout_mid_stream_ends_with_an_error_event(backend):
    with serve(backend, read_timeout_s=0.3) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        hangups = backend.hangups
        t0 = time.monotonic()
        status, body = stream(sc, "2,0,60,stall")
        took = time.monotonic() - t0
        assert status == 200
        assert body.startswith(expected(2, 60)[:-len(DONE)])
        tail = body[len(expected(2, 60)) - len(DONE):]
        assert tail.startswith(b"data: ") and b"no data for 0.3 s" in tail and b'"code": 502' in tail, tail
        assert 0.25 <= took < 3.0, took
        assert wait_until(lambda: backend.hangups == hangups + 1, 5), "the stalled upstream call was not dropped"
        assert sc.app.app.counters["upstream_errors"] == 1
        assert_no_leak(sc)


def test_upstream_cut_mid_stream_ends_with_an_error_event(backend):
    with serve(backend) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        status, body = stream(sc, "3,10,60,close")
        assert status == 200
        ok = expected(3, 60)[:-len(DONE)]
        assert body.startswith(ok)
        assert b"failed mid-stream" in body[len(ok):], body[len(ok):]
        assert_no_leak(sc)


def test_client_hanging_up_mid_stream_drops_the_upstream_call(backend):
    with serve(backend) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        hangups = backend.hangups
        with httpx.Client(timeout=30) as c, c.stream("POST", sc.url + "/v1/chat/completions",
                                                     json={**CHAT, "stream": True},
                                                     headers={"x-stream": "200,20,60,done"}) as r:
            it = r.iter_raw()
            assert next(it).startswith(b'data: {"i":0')
        assert wait_until(lambda: backend.hangups == hangups + 1, 5), "the upstream call outlived its client"
        assert sc.app.app.counters["client_disconnects"] == 1
        assert_no_leak(sc)


def test_head_timeout_holds_for_each_request_on_a_kept_alive_connection(backend):
    """One head timer per connection serves its requests in turn: a slow head on a kept-alive
    connection gets its 408 a full timeout after that head began, not after an earlier one."""
    with serve(backend, header_timeout_s=0.6) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        s = socket.create_connection(("127.0.0.1", sc.app.config.port))
        s.settimeout(5)
        for _ in range(2):
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(0.35)  # the first head's timer is still set when the next head begins
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # never finished
        reply = s.recv(65536)
        took = time.monotonic() - t0
        s.close()
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert 0.5 <= took < 2.0, took
        assert_no_leak(sc)


def test_placement_with_one_live_backend_scores_nothing(monkeypatch):
    """The only live backend is every rule's choice: no score is computed (the mars rule's score
    sums the promises over the backend's roots); with two live backends the rule scores as before."""
    backends = [Backend("http://127.0.0.1:1"), Backend("http://127.0.0.1:2")]
    calls = []
    monkeypatch.setattr(Placement, "score", lambda self, b, tokens=None: calls.append(b) or -len(b.roots))
    for rule in ("mars", "round-robin", "session-hash", "least-loaded"):
        p = Placement(backends, controller=None, rule=rule)
        backends[0].up, backends[1].up = False, True
        assert p.place(f"{rule}-a") is backends[1]
        assert not calls
        backends[0].up = True
        p.place(f"{rule}-b")
        assert bool(calls) == (rule == "mars")
        for b in backends:
            b.roots.clear()
        calls.clear()


def test_the_clients_body_bytes_are_forwarded_with_the_ids_appended(backend):
    """The body goes upstream as the client wrote it (spacing, key order, number forms, non-ASCII
    text), with ``vllm_xargs`` (and the default output limit) written before its closing brace."""
    raw = ('{ "model" : "tiny",\n  "messages": [{"role": "user", "content": "h\u00e9 \u2603 é"}],'
           ' "temperature": 1.0, "stream": true }\n').encode()
    with serve(backend, default_max_tokens=7) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        r = httpx.post(sc.url + "/v1/chat/completions", content=raw, timeout=30,
                       headers={"content-type": "application/json", "x-mars-workflow": "wf-1",
                                "x-mars-last-step": "true"})
        assert r.status_code == 200
        sent = backend.bodies[-1]
        head = raw.rstrip()[:-1]
        assert sent.startswith(head + b',"vllm_xargs":{"mars_workflow":"wf-1"'), sent
        assert sent.endswith(b',"max_tokens":7}')
        got = json.loads(sent)
        assert got["vllm_xargs"]["mars_root"] == "wf-1" and got["max_tokens"] == 7
        assert {k: got[k] for k in json.loads(raw)} == json.loads(raw)
        assert_no_leak(sc)


@pytest.mark.parametrize(("raw", "n0", "respliced"), [
    (b'{"a": 1}', 1, True),
    (b"{}  ", 0, True),
    (b'\xef\xbb\xbf{"a": 1}', 1, True),  # UTF-8 with a byte-order mark
    ('{"a": 1}'.encode("utf-16-le"), 1, False),  # not UTF-8: encoded afresh
    ('{"a": 1}'.encode("utf-16"), 1, False),
    ('{"a": 1}'.encode("utf-32"), 1, False),
    (b'{"a": 1}', None, False),  # a key the client sent changed
])
def test_forward_bytes_appends_only_new_keys_to_utf8_bodies(raw, n0, respliced):
    body = json.loads(raw)
    body["vllm_xargs"] = {"mars_workflow": "w\u00e9\U0001f600\"\\\n", "mars_turn": 3, "mars_last_step": False,
                          "mars_parent": None, "mars_prefill_tokens": 1 << 40, "x": [1.5, {"y": True}]}
    body["max_tokens"] = 5
    out = forward_bytes(raw, body, n0)
    assert json.loads(out) == body
    assert out.startswith(raw.rstrip()[:-1]) == respliced


@pytest.mark.parametrize("raw", [
    b'{"model":"tiny","messages":[{"role":"user","content":"a\xed\xa0\x80b"}]}',  # an encoded lone surrogate
    '{"model":"tiny","messages":[{"role":"user","content":"a\ud800b"}]}'.encode("utf-16", "surrogatepass"),
    b'{"model":"tiny","messages":[{"role":"user","content":"a\xffb"}]}',
])
def test_bodies_that_are_not_valid_unicode_are_400_before_the_engine(backend, raw):
    """Bytes that decode only leniently (a lone surrogate encoded in UTF-8 or UTF-16, a stray byte)
    are a 400 naming the encoding, before admission: never a call forwarded, never a 500."""
    with serve(backend) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        n = len(backend.bodies)
        r = httpx.post(sc.url + "/v1/chat/completions", content=raw, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "request body is not valid UTF-" in r.json()["error"]["message"]
        assert len(backend.bodies) == n
        assert_no_leak(sc)


def test_utf8_with_a_byte_order_mark_and_utf16_bodies_still_pass(backend):
    with serve(backend) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        for raw in (b"\xef\xbb\xbf" + json.dumps(CHAT).encode(), json.dumps(CHAT).encode("utf-16")):
            r = httpx.post(sc.url + "/v1/chat/completions", content=raw, timeout=30,
                           headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            assert json.loads(backend.bodies[-1])["messages"] == CHAT["messages"]
        assert_no_leak(sc)


def _slow_reader_call(port: int, spec: str) -> bytes:
    """A streamed call from a client with a tiny receive buffer that reads slowly (16 KiB then a
    short pause): the sidecar's writes back up and wait for the client."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
              b"content-type: application/json\r\nx-stream: %s\r\ncontent-length: %d\r\n\r\n%s"
              % (spec.encode(), len(body), body))
    time.sleep(0.3)
    got = []
    s.settimeout(30)
    while chunk := s.recv(1 << 14):
        got.append(chunk)
        time.sleep(0.002)
    s.close()
    return b"".join(got)


def test_a_connection_whose_last_write_waited_goes_back_to_the_pool_reading(backend):
    """The last upstream read of a stream (its end) written to a slow client: the write waits with
    upstream reading paused, and the connection then goes back to the pool. It must go back
    reading: a paused connection reused by the next call never sees that call's answer (the call
    hung forever, holding its slot, in the wedge seen under load)."""
    n, size = 48, 128 << 10
    with serve(backend, telemetry_interval_s=30, telemetry_stale_s=60) as sc:  # (no poll takes the connection)
        assert wait_until(lambda: sc.app.any_up, 10)
        port = sc.app.config.port
        for _ in range(3):
            raw = _slow_reader_call(port, f"{n},5,{size},done")
            assert dechunk(raw.partition(b"\r\n\r\n")[2]) == expected(n, size)
            last = [s for s in sc.app.sends if s[0]][-1]
            if last[1] is False and last[2] is True:
                break  # the last write waited for the client
        else:
            pytest.skip("the last write never had to wait for the client")
        pool = sc.app.app.backends[0].pool
        paused = [c for c in pool._idle if not c.transport.is_reading()]
        t0 = time.monotonic()
        try:
            with httpx.Client(timeout=5) as c:
                r = c.post(sc.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                           headers={"x-stream": "3,0,50,done"})
        except httpx.TimeoutException:
            pytest.fail(f"the next call hung ({len(paused)} paused connection(s) in the pool)")
        assert r.status_code == 200 and r.content == expected(3, 50)
        assert time.monotonic() - t0 < 5
        assert not paused, "a paused connection went back to the pool"
        assert_no_leak(sc)


def test_sigterm_with_a_call_stuck_upstream_exits_within_the_grace_period(backend):
    """``mars sidecar`` (the real CLI process) with a streamed call whose backend went silent (no
    read timeout): SIGTERM ends the process within the shutdown grace period, and the stuck call is
    cut: its client connection and its upstream call are closed."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(serving.__file__).parents[3])}
    p = subprocess.Popen([sys.executable, "-m", "vllm_mars.cli", "sidecar", "--backend", backend.url,
                          "--controller", "none", "--port", str(port)], env=env)
    try:
        assert wait_until(lambda: _health(port), 60), "the sidecar did not start"
        dropped = backend.stalls_dropped
        body = json.dumps({**CHAT, "stream": True}).encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(serving.SHUTDOWN_GRACE_S + 5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"x-stream: 1,0,50,stall\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        got = s.recv(65536)
        while b'"i":0' not in got:
            got += s.recv(65536)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(serving.SHUTDOWN_GRACE_S + 5)
        took = time.monotonic() - t0
        assert took < serving.SHUTDOWN_GRACE_S + 3, took
        while chunk := s.recv(65536):  # the client's connection is closed (not left open)
            got += chunk
        s.close()
        assert not got.endswith(b"0\r\n\r\n")  # cut, not a complete answer
        assert wait_until(lambda: backend.stalls_dropped == dropped + 1, 5), "the stuck upstream call was not closed"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _health(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_shutdown_that_overruns_its_bound_is_ended_by_the_watchdog(backend, monkeypatch):
    """Whatever hangs in shutdown (here the app's own shutdown never returns: a fault injected, as
    no real one is known), the watchdog fires once the bound has passed (the CLI's serving process
    then exits at once); a server that finishes in time disarms it."""
    hits: list[float] = []
    hang = asyncio.Event()

    async def stuck(self) -> None:
        await hang.wait()

    app = Sidecar(SidecarConfig(backends=(backend.url,), controller="none", port=free_port()))
    monkeypatch.setattr(Sidecar, "shutdown", stuck)
    srv = serving.sidecar_server(app, 0.5, on_overrun=hits.append)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    assert wait_until(lambda: srv.started, 30)
    t0 = time.monotonic()
    srv.should_exit = True
    assert wait_until(lambda: hits, 10), "the watchdog never fired"
    assert hits == [0.5] and 0.4 < time.monotonic() - t0 < 5
    assert t.is_alive()  # (the injected hang holds the server)
    app._loop.call_soon_threadsafe(hang.set)
    t.join(10)
    assert not t.is_alive()
    monkeypatch.undo()
    # in time: no overrun
    app = Sidecar(SidecarConfig(backends=(backend.url,), controller="none", port=free_port()))
    srv = serving.sidecar_server(app, 0.5, on_overrun=hits.append)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    assert wait_until(lambda: srv.started, 30)
    srv.should_exit = True
    t.join(10)
    time.sleep(0.7)
    assert hits == [0.5]


@pytest.mark.parametrize("end", ["done", "close"])
def test_a_client_that_stops_reading_then_hangs_up_ends_its_call(backend, end):
    """A client with a tiny receive buffer that never reads: the sidecar's write waits with upstream
    reading paused (the backend may meanwhile finish, or close its connection mid-stream); the
    client then hangs up. The call ends at once, its upstream connection is closed (never pooled
    paused) and nothing is left held."""
    n, size = 48, 128 << 10
    with serve(backend) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        app = sc.app.app
        s = _never_reading_call(sc.app.config.port, f"{n},0,{size},{end}")
        assert wait_until(lambda: _paused(app), 10), "upstream reading never paused"
        assert app.in_flight == 1
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
        s.close()
        assert wait_until(lambda: app.in_flight == 0, 5), "the call outlived its client"
        assert app.counters["client_disconnects"] == 1
        assert not app.backends[0].pool._idle or all(c.transport.is_reading() for c in app.backends[0].pool._idle)
        # the sidecar still serves
        assert stream(sc, "3,0,50,done") == (200, expected(3, 50))
        assert_no_leak(sc)


def _never_reading_call(port: int, spec: str) -> socket.socket:
    """A streamed call (``x-stream: spec``) from a raw client with a tiny receive buffer that never
    reads: the sidecar's writes to it back up."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"x-stream: %s\r\ncontent-length: %d\r\n\r\n%s" % (spec.encode(), len(body), body))
    return s


def _paused(app: Sidecar) -> bool:
    """Some open upstream connection has reading paused (a write waits for its client)."""
    return any(c._paused and not c.closed for c in gc.get_objects() if type(c) is _Conn)


def test_upstream_closing_while_a_slow_client_holds_reading_paused_ends_with_an_error_event(backend):
    """The backend sends everything and closes mid-stream while the sidecar's reading is paused for
    a slow client: the client still gets every byte, then the error event, and nothing is held."""
    n, size = 48, 128 << 10
    with serve(backend) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        raw = _slow_reader_call(sc.app.config.port, f"{n},0,{size},close")
        assert any(b is False and e is True for _, b, e in sc.app.sends), "no write had to wait for the client"
        body = dechunk(raw.partition(b"\r\n\r\n")[2])
        ok = expected(n, size)[:-len(DONE)]
        assert body.startswith(ok) and b"failed mid-stream" in body[len(ok):], body[len(ok):][:300]
        assert_no_leak(sc)


def test_a_client_that_stops_reading_for_good_is_cut_after_the_body_timeout(backend):
    """A client that takes none of a streamed answer while keeping its connection open: its call
    ends ``body_timeout_s`` after the write began waiting (it held its slot and its upstream call
    forever before), the upstream call is closed, and the connection is closed with what the sidecar
    still buffered for it dropped."""
    n, size = 48, 128 << 10
    with serve(backend, body_timeout_s=0.5) as sc:
        assert wait_until(lambda: sc.app.any_up, 10)
        app = sc.app.app
        s = _never_reading_call(sc.app.config.port, f"{n},0,{size},done")
        assert wait_until(lambda: _paused(app), 10), "upstream reading never paused"
        t0 = time.monotonic()
        assert wait_until(lambda: app.in_flight == 0, 10), "the call of a client that stopped reading never ended"
        assert time.monotonic() - t0 < 3
        assert app.counters["client_disconnects"] == 1
        s.settimeout(5)
        got = b""
        try:
            while chunk := s.recv(1 << 20):  # what the kernel still held, then the end (never a hang)
                got += chunk
        except ConnectionResetError:
            pass
        s.close()
        assert not got.endswith(b"0\r\n\r\n") and len(got) < n * size  # cut, not completed
        assert not _paused(app)
        assert stream(sc, "3,0,50,done") == (200, expected(3, 50))
        assert_no_leak(sc)


def test_a_log_stream_nobody_reads_never_freezes_the_sidecar(backend):
    """``mars sidecar`` whose stderr is a pipe nobody reads (a parent that stopped reading it): once
    the pipe is full, each log line used to block the event loop in ``write`` (every call hung, and
    SIGTERM was never acted on: the process had to be killed). Log writes happen off the loop now:
    2500 malformed requests (a uvicorn warning each) later it still answers, and SIGTERM ends it."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(serving.__file__).parents[3])}
    p = subprocess.Popen([sys.executable, "-m", "vllm_mars.cli", "sidecar", "--backend", backend.url,
                          "--controller", "none", "--port", str(port)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: _health(port), 60), "the sidecar did not start"
        for i in range(2500):  # ~100 bytes of log each: well past a 64 KiB pipe
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
                    s.sendall(b"GARBAGE \x00\x01 HTTP/9\r\n\r\n")
                    s.recv(100)
            except TimeoutError:
                pytest.fail(f"the sidecar froze after {i} malformed requests")
        assert _health(port)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(serving.SHUTDOWN_BOUND_S + 5)
        assert time.monotonic() - t0 < 3
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
