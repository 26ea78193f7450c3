"""The soak script (benchmark/perf/soak.py) in half a minute: ``mars serve`` with the tiny model on
the real CPU engine, replayed sessions through the sidecar, the hostile clients, and one engine
kill. What the 30-minute run records must hold here too: no workflow lost across the kill (``mars
serve`` restarts its vLLM server, the driver sends the broken calls again), every admission slot
freed, no hostile input answered with a 500 or an empty reply, the engine left with no request,
and no process of ``mars serve`` left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_soak_smoke_with_an_engine_kill(tmp_path):
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, str(REPO / "benchmark" / "perf" / "soak.py"), "--minutes", "0.5",
                        "--kill-every", "15", "--rps", "0.4", "--probe-every", "1", "--sample-every", "2",
                        "--drain", "60", "--out", str(out)],
                       check=False, capture_output=True, text=True, timeout=900)
    assert (out / "soak.json").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "soak.json").read_text())
    wf = res["workflows"]
    assert wf["started"] >= 5 and wf["lost"] == 0 and wf["completed"] == wf["started"], wf
    assert wf["replay_rc"] == 0
    # the kill happened, the sidecar saw the engine go and come back (restarted by mars serve)
    [kill] = res["kills"]
    assert kill["target"] == "api_server" and kill["seen_down"] and kill["up"], kill
    assert "restarting it" in (out / "serve.log").read_text()
    assert res["slots_freed"], res["final_gauges"]
    assert res["engine_end"].get("vllm:num_requests_running") == 0
    assert res["engine_end"].get("vllm:num_requests_waiting") == 0
    assert res["processes_left"] == []
    assert res["hostile"]["bad"] == {}, res["hostile"]
    assert sum(sum(d.values()) for d in res["hostile"]["statuses"].values()) >= 10
    assert res["added_latency_ms"]["probes"] >= 1 and res["added_latency_ms"]["p99"] is not None
    assert res["sidecar_cpu_ms_per_call"] is not None
    assert r.returncode == 0, r.stdout[-3000:]


def _sse_server(answers: list[bytes]):
    """A raw HTTP server on a thread: each POST gets the next of ``answers`` (whole HTTP responses),
    then the connection closes; GET /v1/models and /metrics answer as vLLM's server does."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    posts: list[bytes] = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += c.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                n = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")),
                             b"0"))
                while len(body) < n:
                    body += c.recv(65536)
                if head.startswith(b"GET /v1/models"):
                    out = b'{"data": [{"id": "tiny"}]}'
                elif head.startswith(b"GET"):
                    out = b""
                else:
                    posts.append(body)
                    c.sendall(answers.pop(0) if answers else b"HTTP/1.1 599 none left\r\ncontent-length: 0\r\n\r\n")
                    continue
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                          b"connection: close\r\n\r\n%s" % (len(out), out))

    threading.Thread(target=serve, daemon=True).start()
    return srv, posts


def _sse(events: list[bytes]) -> bytes:
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(body)) + body


def test_http_backend_sends_a_call_again_after_transient_failures():
    """What the engine kill does to a call in flight, one fault each: 503 (no engine up), a stream
    cut off (no [DONE]), a 502 error event mid-stream (the sidecar lost the engine), a 500 (vLLM's
    answer when its engine core died): the call is sent again and completes. A 500 more than 3 times,
    or a 400, fails the call."""
    import asyncio
    import time

    from vllm_mars.driver.backends import HTTPBackend

    tok = b'{"choices": [{"token_ids": [5, 6], "finish_reason": null}]}'
    end = b'{"choices": [{"token_ids": [7], "finish_reason": "length"}], "usage": {"prompt_tokens": 3}}'
    fail500 = (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
               b"connection: close\r\n\r\n{}")
    answers = [b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 0\r\ncontent-length: 2\r\n\r\n{}",
               _sse([tok]),  # cut off: no [DONE]
               _sse([tok, b'{"error": {"message": "backend failed mid-stream", "code": 502}}']),
               fail500,
               _sse([tok, end, b"[DONE]"]),
               fail500, fail500, fail500, fail500,
               b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}"]
    srv, posts = _sse_server(answers)

    async def go():
        b = HTTPBackend(f"http://127.0.0.1:{srv.getsockname()[1]}", time.monotonic, model="tiny")
        await b.start()
        try:
            res = await b.generate("w:t0", [1, 2, 3], 3, {"mars_workflow": "w"})
            assert res.output_ids == [5, 6, 7] and b.retries == 4 and len(posts) == 5
            with pytest.raises(RuntimeError, match="HTTP 500"):
                await b.generate("w:t1", [1], 3, {})
            assert len(posts) == 9
            with pytest.raises(RuntimeError, match="HTTP 400"):
                await b.generate("w:t2", [1], 3, {})
            assert b.engine_stats()["call_retries"] == 7
        finally:
            await b.close()

    try:
        asyncio.run(go())
    finally:
        srv.close()
