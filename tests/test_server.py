"""The real vLLM OpenAI server on 127.0.0.1 with MarsScheduler(mars): serves, and vllm_xargs reach us."""

from __future__ import annotations

import json
import time

import httpx


def _sched_events(server, request_marker: str, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.sched_log.exists():
            recs = [json.loads(line) for line in server.sched_log.read_text().splitlines() if line.strip()]
            hits = [r for r in recs if request_marker in r["request_id"]]
            if any(r["event"] == "end" for r in hits):
                return hits
        time.sleep(0.2)
    raise AssertionError(f"no scheduler events for {request_marker}")


def _arrived(server, request_marker: str) -> bool:
    if not server.sched_log.exists():
        return False
    return any(request_marker in json.loads(line)["request_id"]
               for line in server.sched_log.read_text().splitlines() if line.strip())


def test_completions_with_workflow_xargs_reach_mars_scheduler(openai_server):
    body = {"model": "tiny", "prompt": "def foo(x):", "max_tokens": 7, "ignore_eos": True, "temperature": 0,
            "vllm_xargs": {"mars_workflow": "wf-42", "mars_root": "root-1", "mars_turn": 3,
                           "mars_last_step": False, "mars_tool": "bash"}}
    r = httpx.post(openai_server.url + "/v1/completions", json=body, headers={"X-Request-Id": "xargs-1"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 7
    events = _sched_events(openai_server, "xargs-1")
    arrive = next(e for e in events if e["event"] == "arrive")
    assert (arrive["workflow"], arrive["root"], arrive["turn"], arrive["last_step"], arrive["tool"],
            arrive["tagged"]) == ("wf-42", "root-1", 3, False, "bash", True)
    assert arrive["policy"] == "mars"  # --additional-config '{"mars": {"policy": "mars"}}' took effect
    end = next(e for e in events if e["event"] == "end")
    assert end["output_tokens"] == 7 and end["aborted"] is False


def test_chat_completion_without_tags_is_a_one_call_workflow(openai_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
            "ignore_eos": True}
    r = httpx.post(openai_server.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "plain-1"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    arrive = next(e for e in _sched_events(openai_server, "plain-1") if e["event"] == "arrive")
    assert arrive["tagged"] is False and arrive["last_step"] is True


def test_metrics_expose_kv_usage_and_block_count(openai_server):
    text = httpx.get(openai_server.url + "/metrics", timeout=10).text
    assert "vllm:kv_cache_usage_perc" in text
    assert 'num_gpu_blocks="256"' in text


def test_hostile_vllm_xargs_never_crash_the_engine(openai_server):
    """Issue 11 defect 1: these killed EngineCore (OverflowError in the tag parser). Each is served
    (as an untagged call) or refused by vLLM with a 4xx; the server stays up and serves the next call."""
    raw = ['{"mars_workflow": "h1", "mars_turn": 1e400}', '{"mars_workflow": "h2", "mars_turn": Infinity}',
           '{"mars_workflow": "h3", "mars_turn": -Infinity}', '{"mars_workflow": "h4", "mars_turn": NaN}',
           '{"mars_workflow": "h5", "mars_prefill_tokens": 1e400}',
           '{"mars_workflow": "h6", "mars_prefill_tokens": ' + str(2**1024) + '}',
           '{"mars_workflow": "\\ud800", "mars_last_step": [1], "mars_parent": {"a": 1}}']
    for i, xargs in enumerate(raw):
        body = ('{"model": "tiny", "prompt": "def foo(x): return x + 1", "max_tokens": 2, "ignore_eos": true, "vllm_xargs": '
                + xargs + "}")
        r = httpx.post(openai_server.url + "/v1/completions", content=body, timeout=60,
                       headers={"Content-Type": "application/json", "X-Request-Id": f"hostile-{i}"})
        assert r.status_code in (200, 400), (xargs, r.status_code, r.text[:300])
        assert httpx.get(openai_server.url + "/health", timeout=10).status_code == 200
    arrive = next(e for e in _sched_events(openai_server, "hostile-0") if e["event"] == "arrive")
    assert arrive["tagged"] is False  # served, as an untagged call
    r = httpx.post(openai_server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "def bar(y): return y", "max_tokens": 3, "ignore_eos": True,
                         "vllm_xargs": {"mars_workflow": "after", "mars_turn": 0}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_http_backend_abort_stops_the_call_in_the_server(openai_server):
    """Backend.abort over HTTP: the stream is closed, vLLM aborts the request (it keeps no KV)."""
    import asyncio

    from vllm_mars.driver.backends import HTTPBackend

    async def go():
        b = HTTPBackend(openai_server.url, time.monotonic, poll_s=5.0)
        await b.start()
        try:
            task = asyncio.create_task(b.generate("abort-http-1", list(range(10, 60)), 1900, {}))
            # abort once the server is decoding it (a fixed sleep raced a loaded machine)
            deadline = time.monotonic() + 30
            while not _arrived(openai_server, "abort-http-1") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            await b.abort("abort-http-1")
            try:
                await task
            except asyncio.CancelledError:
                pass
            else:
                raise AssertionError("the aborted call returned")
        finally:
            await b.close()

    asyncio.run(go())
    end = next(e for e in _sched_events(openai_server, "abort-http-1") if e["event"] == "end")
    assert end["aborted"] is True and end["output_tokens"] < 1900, end
