"""A client that goes away mid-call: the engine request is aborted (checked in MarsScheduler's log,
MARS_SCHED_LOG), through the sidecar and straight to vLLM, streaming and not, and the engine is left
with nothing running or waiting and no KV block of the call.

The client leaves at a point the engine cannot have passed, however loaded the box: the engine is
paused first (vLLM's own pause, mode ``keep``, a dev-mode route: calls are taken in, no step runs),
the client leaves once the scheduler logs its call's arrival, and the abort must land while the engine
is still paused, so not one token was generated. A margin cannot do this: in a loaded full run a
client that left once it saw the arrival, with the engine running, saw it after 4.15 s, when the
engine had generated all 1,900 tokens. (A stream the client leaves mid-answer, engine running:
test_sidecar's test_client_disconnect_aborts_upstream, test_server's HTTP backend abort.)"""

from __future__ import annotations

import json
import socket
import time
import uuid
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import free_port
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread
from vllm_mars.admission.telemetry import metric_sum, parse_prometheus

#: What the call asks for, within the fixture's max_model_len (it gets none: it is aborted first).
MAX_TOKENS = 1900
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "temperature": 0}


def _record(server, wf: str, event: str, timeout: float = 20.0) -> dict:
    """The first ``event`` record of workflow ``wf`` in the scheduler's log (only the lines naming
    ``wf`` are parsed: the log holds every call the session's server has seen)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.sched_log.exists():
            for line in server.sched_log.read_text().splitlines():
                if wf in line and (r := json.loads(line))["event"] == event and r["workflow"] == wf:
                    return r
        time.sleep(0.02)
    raise AssertionError(f"no {event} record for {wf} within {timeout} s")


def _engine(server) -> dict[str, float]:
    m = parse_prometheus(httpx.get(server.url + "/metrics", timeout=10).text)
    return {k: metric_sum(m, "vllm:" + k) for k in ("num_requests_running", "num_requests_waiting",
                                                   "kv_cache_usage_perc")}


def _assert_nothing_left(server, kv_before: float, timeout: float = 20.0) -> dict[str, float]:
    """The leak check through vLLM's /metrics: no request running or waiting, and no more KV in use
    than before the call (nothing else runs meanwhile; other workflows' retained KV can only expire)."""
    deadline = time.monotonic() + timeout
    while True:
        e = _engine(server)
        if e["num_requests_running"] == 0 and e["num_requests_waiting"] == 0 \
                and e["kv_cache_usage_perc"] <= kv_before:
            return e
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle {timeout} s after the abort: {e} (KV before: {kv_before})")
        time.sleep(0.1)


@contextmanager
def _paused(server):
    """vLLM's pause, mode ``keep`` (calls are taken in, no step runs) until the block ends."""
    httpx.post(server.url + "/pause", params={"mode": "keep", "clear_cache": "false"},
               timeout=30).raise_for_status()
    try:
        yield
    finally:
        httpx.post(server.url + "/resume", timeout=30).raise_for_status()


def _go_away(server, url: str, wf: str, stream: bool) -> None:
    """Send the call and leave once the engine holds it: a stream once its head (200) has come back,
    a whole answer with nothing come back."""
    body = {**LONG, "stream": stream, "vllm_xargs": {"mars_workflow": wf}}
    u = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {u.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=20) as s:
        s.sendall(head + data)
        _record(server, wf, "arrive")  # the engine holds the call
        if stream:
            got = b""
            while b"\r\n\r\n" not in got and (chunk := s.recv(4096)):
                got += chunk
            assert got.startswith(b"HTTP/1.1 200") and b"data:" not in got, got  # open, no token yet
        else:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)  # nothing has been answered: the call is still open


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts_the_engine_request(openai_server, stream):
    cfg = SidecarConfig(backends=(openai_server.url,), controller="none", port=free_port(),
                        telemetry_interval_s=0.1)
    with SidecarThread(cfg) as sc:
        for path, url in (("direct", openai_server.url), ("sidecar", sc.url)):
            wf = f"disc-{path}-{stream}-{uuid.uuid4().hex[:8]}"  # its own records, however often it runs
            kv_before = _engine(openai_server)["kv_cache_usage_perc"]
            with _paused(openai_server):
                _go_away(openai_server, url, wf, stream)
                end = _record(openai_server, wf, "end")  # while the engine is still paused
            assert end["aborted"] is True and end["output_tokens"] == 0, (path, end)
            if path == "sidecar":
                assert sc.app.counters["client_disconnects"] == 1
            _assert_nothing_left(openai_server, kv_before)
