"""Issue 11: the sidecar under adversarial clients and faulty upstreams. The real sidecar on
127.0.0.1 in front of the real vLLM server (tiny model), or of a real TCP server that misbehaves
on purpose (tests/faulty_backend.py) for faults vLLM cannot be made to produce."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import free_port
from faulty_backend import FaultyBackend
from polling import wait_until
from test_sidecar import CHAT, Call
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread


@pytest.fixture(scope="module")
def sidecar2(openai_server):
    """Window of 2 roots; a failed call's root ends after 0.5 s without calls."""
    cfg = SidecarConfig(backends=(openai_server.url,), controller="mars", port=free_port(),
                        controller_options={"window_min": 2, "window_max": 2, "interval_s": 0.05},
                        telemetry_interval_s=0.1, failed_idle_timeout_s=0.5)
    with SidecarThread(cfg) as sc:
        yield sc


def post(sc, content: bytes | None = None, headers=None, body=None, timeout=30.0):
    h = {"content-type": "application/json", **(headers or {})}
    data = content if content is not None else json.dumps(body or CHAT).encode()
    return httpx.post(sc.url + "/v1/chat/completions", content=data, headers=h, timeout=timeout)


# -- defect 2: out-of-range numbers and lone surrogates are 400, not 500 -------------------------------
@pytest.mark.parametrize("xargs", [
    b'{"mars_workflow": "ov", "mars_turn": 1e400}',
    b'{"mars_workflow": "ov", "mars_turn": Infinity}',
    b'{"mars_workflow": "ov", "mars_turn": -Infinity}',
    b'{"mars_workflow": "ov", "mars_prefill_tokens": ' + str(2**1024).encode() + b"}",
    b'{"mars_workflow": "ov", "mars_prefill_tokens": ' + str(2**40).encode() + b"}",
    b'{"mars_workflow": "' + b"w" * 5000 + b'"}',
])
def test_overflowing_mars_values_are_400(sidecar2, xargs):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "vllm_xargs": ' + xargs + b"}"
    r = post(sidecar2, body)
    assert r.status_code == 400, r.text
    assert "mars_" in r.json()["error"]["message"] or "workflow id" in r.json()["error"]["message"]
    assert sidecar2.app.controller.num_queued == 0 and sidecar2.app.controller.num_active == 0


def test_lone_surrogate_is_400_before_admission(sidecar2):
    for content in (b'"\\ud800"', b'"ok \\uDFFF tail"', b'"\\ud800\\u0041"'):
        body = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": ' + content + b"}]}"
        r = post(sidecar2, body, {"X-MARS-Workflow": "sur"})
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
    assert not sidecar2.app.controller.is_active("sur") and not sidecar2.app.controller.is_queued("sur")
    # a paired surrogate (an emoji written as escapes) is fine
    body = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert post(sidecar2, body).status_code == 200


# -- defect 3: a failed call does not keep its slot -----------------------------------------------------
def test_failed_last_step_and_failed_call_release_their_slots(sidecar2):
    ctl = sidecar2.app.controller
    bad = {**CHAT, "model": "no-such-model"}  # vLLM answers 404
    for wf in ("fl-1", "fl-2"):
        r = post(sidecar2, body=bad, headers={"X-MARS-Workflow": wf, "X-MARS-Last-Step": "true"})
        assert r.status_code == 404
        assert not ctl.is_active(wf)  # ended with its failed last step, at once
    # the window of 2 is free: a new root is admitted at once
    t0 = time.monotonic()
    assert post(sidecar2, headers={"X-MARS-Workflow": "fl-3"}).status_code == 200
    assert time.monotonic() - t0 < 5
    # a failed call that is not a last step: the root ends after failed_idle_timeout_s without calls
    assert post(sidecar2, body=bad, headers={"X-MARS-Workflow": "fl-4"}).status_code == 404
    assert ctl.is_active("fl-4")
    assert wait_until(lambda: not ctl.is_active("fl-4"), 5)
    assert sidecar2.app.counters["failed_finished"] >= 1
    # ... unless the workflow goes on: a successful call keeps it
    assert post(sidecar2, body=bad, headers={"X-MARS-Workflow": "fl-5"}).status_code == 404
    assert post(sidecar2, headers={"X-MARS-Workflow": "fl-5"}).status_code == 200
    time.sleep(1.0)
    assert ctl.is_active("fl-5")
    for wf in ("fl-3", "fl-5"):
        httpx.post(f"{sidecar2.url}/mars/v1/workflows/{wf}/finish", timeout=5)
    assert ctl.num_active == 0


# -- defect 4: the admission queue is bounded and holds no bodies in memory ----------------------------
def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def _spilled_sizes(d) -> list[bool]:
    """Per spilled file: whether it holds a whole 6 MiB body yet."""
    out = []
    for f in d.iterdir():
        try:
            out.append(f.stat().st_size >= 6 << 20)
        except FileNotFoundError:
            pass
    return out


def test_queue_flood_is_bounded_in_calls_bytes_and_memory(openai_server, tmp_path):
    """Bounded in calls, bytes and memory; and a shutdown answers the waiting calls 503 at once
    (no cancelled-task tracebacks after the server's grace period)."""
    spill = tmp_path / "spill"
    spill.mkdir()
    log = open(tmp_path / "sidecar.log", "wb")  # noqa: SIM115 (closed below)
    port = free_port()
    mib = 1 << 20
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_mars.cli", "sidecar", "--backend", openai_server.url, "--port", str(port),
         "--controller-option", "window_min=1", "--controller-option", "window_max=1",
         "--max-queued-calls", "8", "--max-queued-bytes", str(26 * mib), "--spill-dir", str(spill),
         "--retry-after", "7"], start_new_session=True, stderr=log)
    url = f"http://127.0.0.1:{port}"
    calls = []
    try:
        assert wait_until(lambda: _up(url), 30), "sidecar did not start"
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"X-MARS-Workflow": "hold"},
                          timeout=30).status_code == 200  # holds the only slot
        rss0 = _rss(proc.pid)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * (6 * mib)}]}
        for i in range(4):  # 4 x 6 MiB wait (24 MiB); the 5th does not fit the 26 MiB byte bound
            calls.append(Call(url + "/v1/chat/completions", big, {"X-MARS-Workflow": f"big-{i}"}))
        assert wait_until(lambda: _metric(url, "mars_sidecar_waiting_calls") == 4, 30)
        # a call counts as waiting when it takes its share of the byte bound, before its body is
        # spilled and the heap trimmed: wait for the four files, then give the RSS a moment to settle
        assert wait_until(lambda: _spilled_sizes(spill) == [True] * 4, 30)
        wait_until(lambda: _rss(proc.pid) - rss0 < 12 * mib, 10)
        rss1 = _rss(proc.pid)
        r = httpx.post(url + "/v1/chat/completions", json=big, headers={"X-MARS-Workflow": "big-x"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "7" and "queue full" in r.text
        assert len(list(spill.iterdir())) == 4  # the waiting bodies are in files
        for i in range(4):  # small calls fill the call bound (8)
            calls.append(Call(url + "/v1/chat/completions", CHAT, {"X-MARS-Workflow": f"small-{i}"}))
        assert wait_until(lambda: _metric(url, "mars_sidecar_waiting_calls") == 8, 30)
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"X-MARS-Workflow": "small-x"}, timeout=30)
        assert r.status_code == 503 and "queue full" in r.text
        assert _metric(url, "mars_admission_queued") == 8
        # memory per waiting call is small: 24 MiB of waiting bodies cost far less than 24 MiB
        grew = rss1 - rss0
        print(f"RSS {rss0 / mib:.1f} MiB -> {rss1 / mib:.1f} MiB with 4 x 6 MiB calls waiting (+{grew / mib:.1f} MiB)")
        assert grew < 12 * mib, f"RSS grew by {grew / mib:.1f} MiB with 24 MiB of bodies waiting"
    finally:
        t0 = time.monotonic()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    for c in calls:
        c.join(30)
    took = time.monotonic() - t0
    assert list(spill.iterdir()) == []  # the waiting bodies' files are gone
    for c in calls:  # each waiting call was told to come back, not cut
        assert c.resp is not None, c.error
        assert c.resp.status_code == 503 and "shutting down" in c.resp.text, c.resp.text
        assert c.resp.headers["retry-after"] == "7"
    stderr = (tmp_path / "sidecar.log").read_text()
    assert "Traceback" not in stderr and "timeout graceful shutdown exceeded" not in stderr, stderr[-3000:]
    # the 503s above are what show the drain (without it uvicorn cancels them after its 5 s grace
    # period: HTTP 500); this bound only catches a shutdown that hangs
    assert took < 20, f"shutdown took {took:.1f} s"


def test_spilled_body_is_forwarded_intact(openai_server, tmp_path):
    cfg = SidecarConfig(backends=(openai_server.url,), controller="mars", port=free_port(), spill_bytes=1024,
                        spill_dir=str(tmp_path), telemetry_interval_s=0.1,
                        controller_options={"window_min": 1, "window_max": 1, "interval_s": 0.05})
    with SidecarThread(cfg) as sc:
        assert post(sc, headers={"X-MARS-Workflow": "sp-hold"}).status_code == 200
        waiting = Call(sc.url + "/v1/chat/completions", {**CHAT, "user": "u" * 5000}, {"X-MARS-Workflow": "sp-w"})
        assert wait_until(lambda: len(list(tmp_path.iterdir())) == 1, 10)  # spilled while it waits
        httpx.post(f"{sc.url}/mars/v1/workflows/sp-hold/finish", timeout=5)
        waiting.join(60)
        assert waiting.resp is not None and waiting.resp.status_code == 200, waiting.error
        assert waiting.resp.json()["object"] == "chat.completion"
        assert list(tmp_path.iterdir()) == []


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


# -- defect 5: slow-loris ------------------------------------------------------------------------------
def _recv_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            d = s.recv(4096)
            if not d:
                return out
            out += d
    except (TimeoutError, ConnectionResetError):
        return out


def test_slow_loris_header_and_body_timeouts_and_connection_cap(openai_server):
    cfg = SidecarConfig(backends=(openai_server.url,), controller="none", port=free_port(),
                        telemetry_interval_s=0.1, header_timeout_s=1.0, body_timeout_s=1.0, max_connections=30)
    with SidecarThread(cfg) as sc:
        addr = ("127.0.0.1", cfg.port)
        # 27 connections that send nothing and 3 that trickle one header line per 0.3 s
        silent = [socket.create_connection(addr) for _ in range(27)]
        trickle = [socket.create_connection(addr) for _ in range(3)]
        for s in trickle:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        # beyond the cap (30): answered 503 and closed at once
        extra = [socket.create_connection(addr) for _ in range(4)]
        t0 = time.monotonic()
        for s in extra:
            got = _recv_all(s, 2.0)
            assert got.startswith(b"HTTP/1.1 503"), got
        assert time.monotonic() - t0 < 1.5
        for _ in range(5):
            time.sleep(0.3)
            for s in trickle:
                try:
                    s.sendall(b"x-slow: 1\r\n")
                except OSError:
                    pass
        t1 = time.monotonic()
        for s in silent + trickle:
            got = _recv_all(s, 3.0)
            assert got == b"" or got.startswith(b"HTTP/1.1 408"), got
        assert time.monotonic() - t1 < 3.0  # all were closed by the 1 s header timeout, none held
        # a body that never finishes: 408 after body_timeout_s
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"model\"")
        got = _recv_all(s, 5.0)
        assert b" 408 " in got.split(b"\r\n")[0], got
        # an oversized head: 431
        s = socket.create_connection(addr)
        s.sendall(b"GET /health HTTP/1.1\r\n" + b"x-big: " + b"a" * (80 << 10) + b"\r\n\r\n")
        got = _recv_all(s, 5.0)
        assert got.startswith(b"HTTP/1.1 431") or got == b"", got  # closed (a reset may beat the 431)
        for s in silent + trickle + extra:
            s.close()
        # honest clients are served
        assert wait_until(lambda: _up(sc.url), 5)
        assert post(sc).status_code == 200


# -- defects 6, 7: no blind resend; upstream faults reach the client as errors --------------------------
def test_no_blind_resend_and_upstream_faults_are_502():
    with FaultyBackend(free_port()) as fb:
        cfg = SidecarConfig(backends=(fb.url,), controller="none", port=free_port(), telemetry_interval_s=0.1,
                            backend_wait_s=3.0)
        with SidecarThread(cfg) as sc:
            assert wait_until(lambda: _up(sc.url), 5)
            assert post(sc, headers={"X-Fault": "ok"}).status_code == 200
            n0 = fb.posts
            # closed before the response head: the POST reached the backend, so it is not resent
            t0 = time.monotonic()
            r = post(sc, headers={"X-Fault": "close", "X-MARS-Workflow": "rs"})
            assert r.status_code == 502 and "before the response head" in r.text, r.text
            assert time.monotonic() - t0 < 2.0
            time.sleep(0.5)
            assert fb.posts - n0 == 1  # exactly one upstream attempt
            assert not sc.app.controller.is_active("rs")
            assert wait_until(lambda: _up(sc.url), 5)  # up again at its next good poll
            # a body cut off upstream is a 502, never a truncated 200
            r = post(sc, headers={"X-Fault": "truncate"})
            assert r.status_code == 502, (r.status_code, r.content)
            assert wait_until(lambda: _up(sc.url), 5)
            # a status outside the HTTP table: 502 with a message, not a dropped connection
            r = post(sc, headers={"X-Fault": "status999"})
            assert r.status_code == 502 and "999" in r.json()["error"]["message"]
            assert post(sc, headers={"X-Fault": "ok"}).status_code == 200
            assert sc.app.in_flight == 0 and sc.app.controller.num_active == 0


# -- defect 13: trust model with API keys --------------------------------------------------------------
def test_api_keys_scope_workflows_to_their_key(openai_server):
    cfg = SidecarConfig(backends=(openai_server.url,), controller="mars", port=free_port(), api_key="key-one",
                        api_keys=("key-two",), telemetry_interval_s=0.1,
                        controller_options={"window_min": 1, "window_max": 1, "interval_s": 0.05})
    one = {"Authorization": "Bearer key-one"}
    two = {"Authorization": "Bearer key-two"}
    with SidecarThread(cfg) as sc:
        ctl = sc.app.controller
        assert post(sc, headers={**one, "X-MARS-Workflow": "W"}).status_code == 200
        assert ctl.num_active == 1
        # another key naming the same workflow does not join it: it is its own root and waits
        claim = Call(sc.url + "/v1/chat/completions", CHAT, {**two, "X-MARS-Workflow": "W"})
        assert wait_until(lambda: ctl.num_queued == 1, 5)
        time.sleep(0.5)
        assert claim.resp is None
        # and cannot finish the first key's workflow: finishing "W" ends only its own (queued) one
        r = httpx.post(f"{sc.url}/mars/v1/workflows/W/finish", headers=two, timeout=5)
        assert r.json() == {"workflow": "W", "ended": True}
        claim.join(10)
        assert claim.resp is not None and claim.resp.status_code == 409
        assert ctl.num_active == 1 and ctl.num_queued == 0
        assert httpx.post(f"{sc.url}/mars/v1/workflows/W/finish", headers=two, timeout=5).json()["ended"] is False
        assert ctl.num_active == 1
        assert httpx.post(f"{sc.url}/mars/v1/workflows/W/finish", headers=one, timeout=5).json()["ended"] is True
        assert ctl.num_active == 0
        assert post(sc, headers={"Authorization": "Bearer key-three"}).status_code == 401


# -- defect 9: options validated -----------------------------------------------------------------------
@pytest.mark.parametrize("flag,value", [("--telemetry-interval", "0.000001"), ("--idle-timeout", "nan"),
                                        ("--telemetry-stale", "nan"), ("--max-queued-calls", "0"),
                                        ("--header-timeout", "inf")])
def test_bad_sidecar_options_exit_2_naming_the_flag(flag, value):
    p = subprocess.run([sys.executable, "-m", "vllm_mars.cli", "sidecar", "--backend", "http://127.0.0.1:9",
                        flag, value], check=False, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "Traceback" not in p.stderr, p.stderr


# -- one telemetry: the driver's HTTP backend reads /metrics with the sidecar's parser -----------------
def _driver_sample(url: str):
    import asyncio

    from vllm_mars.driver.backends import HTTPBackend

    async def run():
        b = HTTPBackend(url, time.monotonic, poll_s=0.05)
        await b.start()
        try:
            return b.sample()
        finally:
            await b.close()

    return asyncio.run(run())


def test_driver_http_telemetry_is_the_sidecars(openai_server):
    """Before: the driver counted vLLM's null block (256 vs 255) and returned its own sample type."""
    from vllm_mars.admission.base import Telemetry
    from vllm_mars.admission.telemetry import HttpTelemetry

    s = _driver_sample(openai_server.url)
    t = HttpTelemetry(openai_server.url).poll().reading
    assert isinstance(s, Telemetry) and t is not None
    assert s.total_blocks == t.total_blocks == 255 and s.block_size == t.block_size == 32
    assert s.free_blocks is not None and 0 <= s.free_blocks <= s.total_blocks
    assert s.running is not None and s.waiting is not None and s.preemptions == 0


def test_driver_http_telemetry_over_data_parallel_engines():
    """Two engines behind one server: usage is averaged, blocks add up (before: usage summed to
    1.3 and free blocks went negative)."""
    page = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.6\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.7\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1001"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1001"} 1.0\n'
        'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="tiny"} 4.0\n'
        'vllm:num_preemptions_total{engine="0",model_name="tiny"} 2.0\n'
    )
    with FaultyBackend(free_port()) as fb:
        fb.metrics = page
        s = _driver_sample(fb.url)
    assert s.total_blocks == 2000 and s.free_blocks == 700 and abs(s.kv_usage - 0.65) < 1e-9
    assert s.running == 7 and s.preemptions == 0  # a delta since the backend started


# -- root lifecycle in virtual time --------------------------------------------------------------------
def test_root_lifecycle_runs_in_virtual_time():
    """RootTable with a real controller on a VirtualClock: admission, the idle and failed-call
    timeouts and last-step ends, with no event loop and no sleeping."""
    from vllm_mars.admission.base import make_controller
    from vllm_mars.admission.identity import identify
    from vllm_mars.admission.roots import RootTable
    from vllm_mars.clock import VirtualClock

    clock = VirtualClock()
    ctl = make_controller("concur", {"window_min": 1, "window_max": 1})
    admitted, ended = [], []
    rt = RootTable(ctl, clock, idle_timeout_s=100.0, failed_idle_timeout_s=5.0,
                   on_admit=lambda r: admitted.append(r.root), on_end=lambda r: ended.append(r.root))

    def ident(wf, last=False):
        return rt.sessions.resolve(identify({"x-mars-workflow": wf, "x-mars-last-step": str(last).lower()}, {}))

    a = rt.arrive(ident("A"), 100)
    b = rt.arrive(ident("B"), 100)
    assert a.admitted and not b.admitted and admitted == ["A"]
    rt.call_started(a, ident("A"))
    clock.advance(50)
    rt.call_ended(a, ident("A"), ok=True)
    clock.advance(99)
    assert rt.expire() == [] and ctl.is_active("A")
    clock.advance(2)  # 101 s idle
    assert rt.expire() == ["A"] and admitted == ["A", "B"] and ended == ["A"]
    rt.call_started(b, ident("B"))
    rt.call_ended(b, ident("B"), ok=False)  # a failed call: B ends after 5 s without calls
    clock.advance(4)
    assert rt.expire() == []
    clock.advance(2)
    assert rt.expire() == ["B"]
    assert rt.counters == {"finished": 2, "idle_finished": 1, "failed_finished": 1, "inferred_ends": 2, "resumed": 0}
    c = rt.arrive(ident("C"), 10)
    rt.call_started(c, ident("C", last=True))
    rt.call_ended(c, ident("C", last=True), ok=False)  # a failed last step still ends the workflow
    assert ended == ["A", "B", "C"] and ctl.num_active == 0 and rt.roots == {}


def test_mars_serve_checks_the_policy_before_launching_vllm(tmp_path):
    t0 = time.monotonic()
    for extra in (["--policy", "nosuch"], ["--policy", "mars", "--policy-option", "nope=1"]):
        p = subprocess.run([sys.executable, "-m", "vllm_mars.cli", "serve", str(tmp_path), *extra], check=False,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and ("nosuch" in p.stderr or "nope" in p.stderr)
    assert time.monotonic() - t0 < 30  # no vLLM was started


# -- issue 35 item 5: a client that goes away is seen without a watcher task per call ----------------------
@pytest.mark.parametrize("guarded", [True, False], ids=["connection-guard-hook", "plain-uvicorn-watcher"])
def test_client_gone_mid_call_ends_the_call_with_or_without_the_guard(guarded):
    """Served by the connection guard, the guard's disconnect hook cancels the call; served by plain
    uvicorn (no hook in the scope), the watcher task does. Either way the upstream call that never
    answers is dropped and the sidecar holds nothing for it."""
    import threading

    import uvicorn
    from vllm_mars.admission.sidecar import Sidecar
    from vllm_mars.admission.sidecar.serving import ServerThread

    with FaultyBackend(free_port()) as fb:
        cfg = SidecarConfig(backends=(fb.url,), controller="none", port=free_port(), telemetry_interval_s=0.1)
        t = ServerThread(Sidecar(cfg))
        if not guarded:
            t.server = uvicorn.Server(uvicorn.Config(t.app, host=cfg.host, port=cfg.port, lifespan="on",
                                                     log_level="warning"))
            t.thread = threading.Thread(target=t.server.run, daemon=True)
        with t as sc:
            assert wait_until(lambda: _up(sc.url), 5)
            n0 = fb.posts
            body = json.dumps(CHAT).encode()
            s = socket.create_connection(("127.0.0.1", cfg.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"x-fault: hang\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert wait_until(lambda: fb.posts == n0 + 1 and sc.app.in_flight == 1, 5)
            s.close()
            assert wait_until(lambda: sc.app.in_flight == 0, 5), "the call outlived its client"
            assert sc.app.counters["client_disconnects"] == 1
            assert not sc.app.roots and sc.app.controller.num_active == 0
