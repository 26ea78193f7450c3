"""Retained KV ends at its expiry on an idle engine (issue 35, hole 12).

vLLM's engine core waits on its input queue while it has no requests; a retention that expired then
stayed held until the next request arrived, and ``/metrics`` kept counting its blocks as used. Real
OpenAI server (its own engine-core process), tiny model, one tagged non-last call, then no traffic
to the engine at all (``/metrics`` is answered by the API server process).
"""

from __future__ import annotations

import re
import time

import httpx
import psutil
from conftest import ServerProcess

RETENTION_S = 3.0


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def _engine_core(server: ServerProcess) -> psutil.Process:
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    cores = [p for p in procs if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert cores, [(p.pid, p.name()) for p in procs]
    return cores[0]


def test_retention_ends_on_time_with_no_traffic(tiny_model, tmp_path):
    server = ServerProcess(tiny_model, tmp_path, policy="mars", num_blocks=64, max_model_len=1024, max_num_seqs=4,
                           policy_options={"max_retention_s": RETENTION_S, "cold_start_tau_s": RETENTION_S})
    try:
        server.wait_ready()
        core = _engine_core(server)
        body = {"model": "tiny", "prompt": "def foo(x):\n    return x + 1\n" * 12, "max_tokens": 4,
                "ignore_eos": True, "temperature": 0,
                "vllm_xargs": {"mars_workflow": "idle-wf", "mars_turn": 0, "mars_last_step": False,
                               "mars_tool": "bash"}}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        ended = time.monotonic()
        assert r.status_code == 200, r.text
        usage = _metric(httpx.get(server.url + "/metrics", timeout=10).text, "vllm:kv_cache_usage_perc")
        assert usage > 0, "the call's KV must be retained (the scenario needs a retention)"
        cpu0 = sum(core.cpu_times()[:2])
        freed_at = None
        while time.monotonic() < ended + RETENTION_S * 1.05 + 15:
            text = httpx.get(server.url + "/metrics", timeout=10).text
            if _metric(text, "vllm:kv_cache_usage_perc") == 0:
                freed_at = time.monotonic()
                break
            time.sleep(0.25)
        cpu = sum(core.cpu_times()[:2]) - cpu0
        assert freed_at is not None, "retained KV outlived max_retention_s on an idle engine"
        # Held for its retention (not dropped at once), released soon after it expired.
        assert RETENTION_S * 0.9 <= freed_at - ended <= RETENTION_S * 1.05 + 10, freed_at - ended
        # No busy wait while the retention was held: the engine core slept until the expiry.
        assert cpu < 0.35 * (freed_at - ended), (cpu, freed_at - ended)
        # Leak check: nothing running or waiting, every block free (no retention left behind).
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert _metric(text, "vllm:num_requests_running") == 0
        assert _metric(text, "vllm:num_requests_waiting") == 0
        assert _metric(text, "vllm:kv_cache_usage_perc") == 0
    finally:
        server.stop()
    ends = [line for line in server.sched_log.read_text().splitlines() if '"event": "end"' in line]
    assert len(ends) == 1 and '"aborted": false' in ends[0]
