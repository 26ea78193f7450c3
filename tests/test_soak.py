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
    assert res["added_latency_ms"]["probes"] >= 3 and res["added_latency_ms"]["p99"] is not None
    assert res["sidecar_cpu_ms_per_call"] is not None
    assert r.returncode == 0, r.stdout[-3000:]
