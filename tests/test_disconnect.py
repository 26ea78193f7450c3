"""A client that goes away mid-call: the engine request is aborted (checked in MarsScheduler's log,
MARS_SCHED_LOG), through the sidecar and straight to vLLM, streaming and not."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import free_port
from vllm_mars.admission.sidecar import SidecarConfig, SidecarThread

#: Long enough that the engine is still generating well after the client has gone (~3 s of decode
#: steps on the tiny CPU model against a disconnect at 0.5 s), within the fixture's max_model_len.
MAX_TOKENS = 1900
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "temperature": 0}


def _end(server, wf: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.sched_log.exists():
            for line in server.sched_log.read_text().splitlines():
                r = json.loads(line)
                if r["event"] == "end" and r["workflow"] == wf:
                    return r
        time.sleep(0.05)
    raise AssertionError(f"no end record for {wf}")


def _go_away(url: str, wf: str, stream: bool) -> None:
    body = {**LONG, "stream": stream, "vllm_xargs": {"mars_workflow": wf}}
    if stream:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            it = r.iter_lines()
            for _ in range(4):
                next(it)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts_the_engine_request(openai_server, stream):
    cfg = SidecarConfig(backends=(openai_server.url,), controller="none", port=free_port(),
                        telemetry_interval_s=0.1)
    with SidecarThread(cfg) as sc:
        for url, wf in ((openai_server.url, f"disc-direct-{stream}"), (sc.url, f"disc-sidecar-{stream}")):
            _go_away(url, wf, stream)
            end = _end(openai_server, wf)
            assert end["aborted"] is True and end["output_tokens"] < MAX_TOKENS, (
                url, "direct" if url == openai_server.url else "sidecar", end["aborted"], end["output_tokens"])
