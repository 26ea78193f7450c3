"""Issue 35: the holes a hostile client still found in the sidecar. The real sidecar on 127.0.0.1 in
front of a real TCP server that answers like vLLM (tests/faulty_backend.py: it counts the calls
that reached it, so a test can tell a call rejected before the engine from one executed and lost).
Each test ends with the leak check: no slot, waiting call, byte or call in flight held."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, unquote

import httpx
import pytest
from conftest import free_port
from faulty_backend import FaultyBackend
from polling import wait_until
from test_sidecar import CHAT
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread
from vllm_mars.workflow import safe_dirname, safe_id

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fake():
    with FaultyBackend(free_port()) as fb:
        yield fb


@pytest.fixture(scope="module")
def sc(fake):
    cfg = SidecarConfig(backends=(fake.url,), port=free_port(), telemetry_interval_s=0.05,
                        controller_options={"window_min": 4, "window_max": 4, "interval_s": 0.02})
    with SidecarThread(cfg) as s:
        assert wait_until(lambda: s.app.any_up, 10)
        yield s


def post(sc, body: bytes | dict, headers=None, path="/v1/chat/completions"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(sc.url + path, content=data, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_no_leak(sc) -> None:
    app = sc.app
    assert wait_until(lambda: app.in_flight == 0 and app.controller.num_active == 0
                      and app.controller.num_queued == 0, 5), (app.in_flight, app.controller.num_active)
    assert app.queue_budget.calls == 0 and app.queue_budget.bytes == 0
    assert not app.roots


def nested(depth: int, leaf: str = '"x"') -> str:
    return "[" * depth + leaf + "]" * depth


# -- hole 1: deep nesting is a 400 naming the field, never a 500 ------------------------------------
@pytest.mark.parametrize(("path", "field", "make"), [
    ("/v1/chat/completions", "messages",
     lambda d: '{"model":"tiny","messages":[{"role":"user","content":' + nested(d) + "}]}"),
    ("/v1/chat/completions", "messages",
     lambda d: '{"model":"tiny","messages":[{"role":"assistant","content":"",'
               '"tool_calls":' + nested(d, '{"a":1}') + "}]}"),
    ("/v1/completions", "prompt", lambda d: '{"model":"tiny","prompt":' + nested(d) + "}"),
    ("/v1/responses", "input", lambda d: '{"model":"tiny","input":' + nested(d) + "}"),
    ("/v1/responses", "instructions", lambda d: '{"model":"tiny","instructions":' + nested(d) + "}"),
])
@pytest.mark.parametrize("depth", [600, 900])
def test_deep_nesting_is_400_naming_the_field(sc, fake, path, field, make, depth):
    posts = fake.posts
    r = post(sc, make(depth).encode(), {"X-MARS-Workflow": "deep"}, path)
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]["message"]
    assert repr(field) in msg and "nested" in msg, msg
    assert fake.posts == posts  # never reached the engine
    assert_no_leak(sc)


def test_moderate_nesting_still_passes(sc, fake):
    schema: dict = {"type": "string"}
    for _ in range(20):  # a tool's JSON schema 40 levels deep
        schema = {"type": "object", "properties": {"p": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    r = post(sc, {**CHAT, "tools": tools}, {"X-MARS-Workflow": "mod", "X-MARS-Last-Step": "true"})
    assert r.status_code == 200, r.text
    assert_no_leak(sc)


def test_text_len_and_item_key_take_any_depth():
    from vllm_mars.admission.continuity import prompt_prefix
    from vllm_mars.admission.identity import estimate_prompt_tokens

    deep: object = "abcd"
    for _ in range(5000):
        deep = [deep]
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": deep}]}) == 1
    assert len(prompt_prefix({"messages": [{"role": "user", "content": deep}]})) == 1


# -- hole 2: control characters and unicode in ids -------------------------------------------------
BAD_IDS = ["a\rb", "a\nb", "a\x00b", "a\x7fb", "a\x01b", "???-é", "日本語", "x\r\nSet-Cookie: y=1"]


@pytest.mark.parametrize("key", ["vllm_xargs", "session_id", "prompt_cache_key"])
def test_control_chars_and_unicode_ids_are_encoded_not_lost(sc, fake, key):
    for i, wid in enumerate(BAD_IDS):
        wid = f"{wid}-{key}-{i}"
        body = dict(CHAT)
        if key == "vllm_xargs":
            body["vllm_xargs"] = {"mars_workflow": wid, "mars_last_step": True}
        else:
            body[key] = wid
        posts = fake.posts
        r = post(sc, body)
        assert r.status_code == 200, r.text  # an answer, never an empty reply after the engine ran it
        assert fake.posts == posts + 1
        hdr = r.headers["x-mars-workflow"]
        assert unquote(hdr) == wid and hdr == safe_id(wid)  # encoded, one to one
        assert all(0x20 < ord(c) < 0x7F for c in hdr)
        if key != "vllm_xargs":  # session ids are not last steps: finish it by its encoded id
            f = httpx.post(f"{sc.url}/mars/v1/workflows/{hdr}/finish", timeout=5)
            assert f.json() == {"workflow": wid, "ended": True}, (wid, f.text)
    assert_no_leak(sc)


def test_safe_id_is_one_to_one_and_safe():
    ids = ["a/b", "a_b", "a%2Fb", "a%2fb", ".", "..", "...", "a b", "é", "e\u0301", "", "x" * 2000]
    enc = [safe_id(v) for v in ids]
    assert len(set(enc)) == len(ids)
    assert all(unquote(e) == v for e, v in zip(enc, ids, strict=True) if v)
    dirs = [safe_dirname(v) for v in ids]
    assert len(set(dirs)) == len(ids) and all(len(d) <= 120 for d in dirs)
    assert not {".", ".."} & set(dirs) and not any("/" in d or "\x00" in d for d in dirs)
    # a bounded name never equals another id's name: "%h" never appears in an encoding
    long = safe_dirname("y" * 500)
    assert safe_dirname(long) != long


# -- hole 8: tool workspaces are one per workflow and never outside the root ------------------------
def test_tool_workspaces_do_not_escape_or_merge(tmp_path):
    from vllm_mars.agents.runner import _safe
    from vllm_mars.driver.tools import RealTools, _safe_name

    for enc in (_safe_name, _safe):
        names = [enc(v) for v in (".", "..", "a/b", "a_b", "a\\b", "../x")]
        assert len(set(names)) == len(names)
        assert not {".", ".."} & set(names) and not any("/" in n for n in names)
    import time

    tools = RealTools(time.monotonic, tmp_path / "ws", cores=[0], sandbox="none")
    root = (tmp_path / "ws").resolve()
    for wf in (".", "..", "a/b", "a_b"):
        ws = tools.workspace(wf)
        assert ws.parent == root, (wf, ws)
    assert tools.workspace("a/b") != tools.workspace("a_b")


# -- hole 10: ids with "/" can be finished, raw and %2F-encoded ------------------------------------
@pytest.mark.parametrize("enc", [lambda w: w, lambda w: quote(w, safe="")])
def test_finish_ids_with_slashes(sc, enc):
    wid = "org/repo-1"
    r = post(sc, CHAT, {"X-MARS-Workflow": wid})
    assert r.status_code == 200 and sc.app.controller.is_active(wid)
    f = httpx.post(f"{sc.url}/mars/v1/workflows/{enc(wid)}/finish", timeout=5)
    assert f.status_code == 200 and f.json() == {"workflow": wid, "ended": True}, f.text
    assert_no_leak(sc)


# -- hole 13: a wrongly typed mars_* key is a 400 naming it, not a call served untagged ---------------
@pytest.mark.parametrize(("xargs", "field"), [
    ({"mars_workflow": "t13", "mars_next_tool": ["x"]}, "mars_next_tool"),
    ({"mars_workflow": "t13", "mars_next_tool": {"a": 1}}, "mars_next_tool"),
    ({"mars_workflow": "t13", "mars_tool": ["x"]}, "mars_tool"),
    ({"mars_workflow": "t13", "mars_root": 1.5}, "mars_root"),
    ({"mars_workflow": "t13", "mars_parent": True}, "mars_parent"),
    ({"mars_workflow": "t13", "mars_last_step": "maybe"}, "mars_last_step"),
    ({"mars_workflow": "t13", "mars_next_tool": "t" * 2000}, "mars_next_tool"),
])
def test_wrongly_typed_tags_are_400(sc, fake, xargs, field):
    posts = fake.posts
    r = post(sc, {**CHAT, "vllm_xargs": xargs}, {"X-MARS-Workflow": "t13h"})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert fake.posts == posts
    assert_no_leak(sc)


# -- hole 6: an empty API key is refused, never "no authentication" ----------------------------------
@pytest.mark.parametrize("kw", [{"api_key": ""}, {"api_keys": ("",)}, {"api_key": "k", "api_keys": ("",)},
                                {"backend_api_key": ""}, {"api_key": "a\x00b"}])
def test_empty_api_key_is_rejected(kw):
    with pytest.raises(ValueError, match="api_key"):
        SidecarConfig(backends=("http://127.0.0.1:1",), **kw)


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_mars.cli", *args], check=False, capture_output=True,
                          text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_cli_rejects_empty_key_and_bad_file_options(tmp_path):
    base = ["sidecar", "--backend", "http://127.0.0.1:1", "--port", str(free_port())]
    r = _cli(*base, "--api-key", "")
    assert r.returncode != 0 and "--api-key" in r.stderr and "non-empty" in r.stderr, r.stderr
    r = _cli(*base, "--spill-dir", "/nonexistent/mars-spill")
    assert r.returncode != 0 and "--spill-dir" in r.stderr and "not a directory" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line, no traceback
    r = _cli(*base, "--events", "/nonexistent/dir/events.jsonl")
    assert r.returncode != 0 and "--events" in r.stderr, r.stderr


# -- hole 11: an events file that cannot be written loses events, never a call or the finish route ---
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_events_to_dev_full_never_500(fake):
    cfg = SidecarConfig(backends=(fake.url,), port=free_port(), telemetry_interval_s=0.05,
                        events_path="/dev/full", controller_options={"interval_s": 0.02})
    with SidecarThread(cfg) as s:
        assert wait_until(lambda: s.app.any_up, 10)
        for i in range(3):
            r = post(s, CHAT, {"X-MARS-Workflow": f"full-{i}"})
            assert r.status_code == 200
            f = httpx.post(f"{s.url}/mars/v1/workflows/full-{i}/finish", timeout=5)
            assert f.status_code == 200 and f.json()["ended"], f.text
        assert s.app.counters["event_write_errors"] >= 1
        assert "mars_sidecar_event_write_errors_total" in httpx.get(s.url + "/metrics", timeout=5).text
        assert_no_leak(s)


# -- hole 3: a body's parsed size is bounded and counted against the byte budget before parsing -----
def test_body_memory_is_counted_before_parsing(fake):
    cfg = SidecarConfig(backends=(fake.url,), port=free_port(), telemetry_interval_s=0.05,
                        max_queued_bytes=50 << 20, controller_options={"interval_s": 0.02})
    with SidecarThread(cfg) as s:
        assert wait_until(lambda: s.app.any_up, 10)

        def empties(n: int) -> bytes:  # n empty arrays in a field: ~30x its bytes once parsed
            return b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],"x":[' + b",".join(
                [b"[]"] * n) + b"]}"

        r = post(s, empties(250_000), {"X-MARS-Workflow": "m1", "X-MARS-Last-Step": "1"})  # charged ~40 MB
        assert r.status_code == 200, r.text[:300]
        posts = fake.posts
        r = post(s, empties(400_000), {"X-MARS-Workflow": "m2"})  # charged ~64 MB: over the 50 MiB budget
        assert r.status_code == 503 and "queue full" in r.text and "retry-after" in r.headers, r.text[:300]
        r = post(s, b'{"model":"tiny","messages":[],"x":[' + b",".join([b"0"] * 2_100_000) + b"]}",
                 {"X-MARS-Workflow": "m3"})
        assert r.status_code == 400 and "JSON values" in r.text, r.text[:300]
        assert fake.posts == posts
        assert s.app.queue_budget.bytes == 0
        assert_no_leak(s)


# -- hole 4: a total deadline per body; idle and slow connections cannot hold every cap slot ---------
def _recv_head(sock, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    try:
        while b"\r\n\r\n" not in out:
            d = sock.recv(4096)
            if not d:
                break
            out += d
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _trickle(addr, n_chunks: int, gap: float, box: list) -> None:
    import socket
    import time

    s = socket.create_connection(addr)
    box.append(s)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 1000\r\n\r\n{\"model\"")
    for _ in range(n_chunks):
        time.sleep(gap)
        try:
            s.sendall(b" ")
        except OSError:
            break


def test_body_deadline_and_cap_slots_go_to_new_clients(fake):
    import socket
    import threading
    import time

    cfg = SidecarConfig(backends=(fake.url,), port=free_port(), telemetry_interval_s=0.05, body_timeout_s=1.0,
                        body_deadline_s=1.5, max_connections=4, controller_options={"interval_s": 0.02})
    addr = ("127.0.0.1", cfg.port)
    with SidecarThread(cfg) as s:
        assert wait_until(lambda: s.app.any_up, 10)
        # a body trickled a byte per 0.3 s (never 1 s apart): 408 by the 1.5 s total deadline
        t0 = time.monotonic()
        box: list = []
        th = threading.Thread(target=_trickle, args=(addr, 20, 0.3, box))
        th.start()
        while not box and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        got = _recv_head(box[0], 10)
        while b"}}" not in got and b"\r\n\r\n" in got:
            box[0].settimeout(5)
            got += box[0].recv(4096)
        took = time.monotonic() - t0
        assert b" 408 " in got.split(b"\r\n")[0] and b"not complete within 1.5 s" in got, got
        assert took < 5, took  # (the trickle goes on for 6 s)
        th.join(15)
        box[0].close()
        # four idle keep-alive connections fill the cap: a new client is still served
        idle = []
        for _ in range(4):
            c = socket.create_connection(addr)
            c.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert _recv_head(c, 5).startswith(b"HTTP/1.1 200")
            idle.append(c)
        assert post(s, CHAT).status_code == 200
        # four tricklers fill the cap: past the grace period a new client takes the slowest one's slot
        tricklers = []
        for _ in range(4):
            c = socket.create_connection(addr)
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
            tricklers.append(c)
        time.sleep(2.2)
        for c in tricklers:
            c.sendall(b" ")
        assert post(s, CHAT).status_code == 200
        for c in idle + tricklers:
            c.close()
        assert_no_leak(s)


# -- issue 34: no import circle between the sidecar and its serving module ---------------------------
def test_serving_does_not_import_the_sidecar():
    import ast

    from vllm_mars.admission.sidecar import serving

    tree = ast.parse(Path(serving.__file__).read_text())
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in names if m and m.startswith("vllm_mars.admission.sidecar")], names  # even lazily


# -- hole 5: each API key gets a fair share of the admission window ----------------------------------
def test_api_keys_get_fair_shares_of_the_window(fake, tmp_path):
    import time

    events = tmp_path / "events.jsonl"
    cfg = SidecarConfig(backends=(fake.url,), port=free_port(), telemetry_interval_s=0.05, api_key="key-a",
                        api_keys=("key-b",), events_path=str(events),
                        controller_options={"window_min": 4, "window_max": 4, "interval_s": 0.05})
    with SidecarThread(cfg) as s:
        assert wait_until(lambda: s.app.any_up, 10)
        a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
        for i in range(4):  # key A: four roots between calls (no last step) fill the window of 4
            assert post(s, CHAT, {**a, "X-MARS-Workflow": f"a-{i}"}).status_code == 200
        assert s.app.controller.num_active == 4
        t0 = time.monotonic()
        r = post(s, CHAT, {**b, "X-MARS-Workflow": "b-0", "X-MARS-Last-Step": "1"})  # waits for a slot
        took = time.monotonic() - t0
        assert r.status_code == 200 and took < 8, (r.status_code, took)  # not the 600 s idle timeout
        ctl = s.app.controller
        assert ctl.num_active == 3  # A gave up one root (its longest idle), B's call ended
        for i in range(4):
            httpx.post(f"{s.url}/mars/v1/workflows/a-{i}/finish", headers=a, timeout=5)
        assert_no_leak(s)
    recs = [json.loads(x) for x in events.read_text().splitlines()]
    fair = [e for e in recs if e.get("rule") == "fair_share"]
    assert len(fair) == 1 and fair[0]["workflow"].endswith("/a-0") and fair[0]["share"] == 2, fair
