"""A client that goes away mid-call: the engine request is aborted (checked in MarsScheduler's log,
MARS_SCHED_LOG), through the sidecar and straight to vLLM, streaming and not.

The client leaves at a point fixed by the engine, not by a timer: a streaming client after its first
chunks, a non-streaming one once the engine's log shows the call arrived. An earlier version left on
a 0.5 s read timeout; in a loaded CI run the client's timer fired seconds late (the same process
also runs the sidecar's thread) and the engine had finished all its tokens by then."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import free_port
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread

#: Long enough that the engine is still generating well after the client has gone (seconds of
#: decode steps on the tiny CPU model), within the fixture's max_model_len.
MAX_TOKENS = 1900
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "temperature": 0}


def _record(server, wf: str, event: str, timeout: float = 20.0) -> dict:
    """The first ``event`` record of workflow ``wf`` in the scheduler's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.sched_log.exists():
            for line in server.sched_log.read_text().splitlines():
                r = json.loads(line)
                if r["event"] == event and r["workflow"] == wf:
                    return r
        time.sleep(0.02)
    raise AssertionError(f"no {event} record for {wf} within {timeout} s")


def _go_away(server, url: str, wf: str, stream: bool) -> None:
    body = {**LONG, "stream": stream, "vllm_xargs": {"mars_workflow": wf}}
    if stream:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            it = r.iter_lines()
            for _ in range(4):
                next(it)
        return
    u = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {u.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head + data)
        _record(server, wf, "arrive")  # the engine is working on it
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            s.recv(1)  # and nothing has been answered yet: the call is still running


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts_the_engine_request(openai_server, stream):
    cfg = SidecarConfig(backends=(openai_server.url,), controller="none", port=free_port(),
                        telemetry_interval_s=0.1)
    with SidecarThread(cfg) as sc:
        for url, wf in ((openai_server.url, f"disc-direct-{stream}"), (sc.url, f"disc-sidecar-{stream}")):
            t0 = time.monotonic()
            _go_away(openai_server, url, wf, stream)
            gone = time.monotonic() - t0
            end = _record(openai_server, wf, "end")
            path = "direct" if url == openai_server.url else "sidecar"
            assert end["aborted"] is True and end["output_tokens"] < MAX_TOKENS, (
                path, end["aborted"], end["output_tokens"], f"client left after {gone:.2f} s")
            if path == "sidecar":
                assert sc.app.counters["client_disconnects"] == 1
