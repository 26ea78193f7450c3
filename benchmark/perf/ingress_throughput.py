"""Ingress throughput: how many calls per second one admission ingress process sustains, and so how
many replicas one ingress serves at the paper's call rates.

The ingress is ``mars sidecar`` (controller ``mars``, window = clients so admission never throttles
and every call still takes the full path: identity, offer/tick, placement, finish) in front of the
trivial backend of ``sidecar_overhead.py`` (reused: a uvicorn app that streams ``--chunks`` SSE
chunks, no delay, so the ingress is the slowest part). With ``--ray`` the Ray ingress is measured
too: the gate of :mod:`vllm_mars.serve_ray` (the sidecar whose backends are Serve replicas, fed by
MarsRouter) over two trivial Serve replicas whose engine is that same backend; and, in the gate's
process, the CPU one call costs when it goes through the Serve handle instead (300 calls, 16 at a
time), the data path the gate does not use.

For each closed-loop concurrency in ``--levels``, phases alternate direct / through the ingress
``--rounds`` times. Reported per level (medians over rounds): calls/s through the ingress, p50/p99
latency added against direct in the same round, and the ingress process's CPU per call (from
/proc). The sustained rate of one ingress is ``1000 / CPU ms per call`` on its one core (it is one
asyncio thread): on this shared box the wall-clock rates are bounded by the three processes
sharing two cores, the CPU per call is not.

The paper's call rate per replica: the highest root arrival rate of its H200 grid
(``experiments/paper/fig10_h200.toml``, 4x the knee) times the mean LLM calls per workflow of the
same ILR preset (generated here, children included); the largest over ILR-1..4 is used.

    .venv/bin/python benchmark/perf/ingress_throughput.py                 # sidecar ingress
    .venv/bin/python benchmark/perf/ingress_throughput.py --ray --record  # + the Ray ingress, JSON
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import sidecar_overhead as so


# -- the paper's call rate per replica -------------------------------------------------------------
def paper_call_rate(grid: Path = REPO / "experiments" / "paper" / "fig10_h200.toml") -> dict:
    """Calls/s per replica at the paper's highest load: max over the grid's workloads of (highest
    roots/s) x (mean LLM calls per workflow of that preset)."""
    from vllm_mars.workload.ilr import generate, load_preset

    def calls(w) -> int:
        return len(w.turns) + sum(calls(c) for c in (getattr(w, "children", None) or []))

    spec = tomllib.loads(grid.read_text())
    rows = []
    for wl in spec["workloads"]:
        wfs = generate(load_preset(wl["preset"]))
        per_wf = statistics.fmean(calls(w) for w in wfs)
        top = max(wl["rps"])
        rows.append({"preset": wl["preset"], "roots_per_s": top, "calls_per_workflow": round(per_wf, 2),
                     "calls_per_s": round(top * per_wf, 3)})
    worst = max(rows, key=lambda r: r["calls_per_s"])
    return {"grid": str(grid.relative_to(REPO)), "per_preset": rows, "calls_per_s_per_replica": worst["calls_per_s"],
            "from": worst["preset"]}


# -- the Ray ingress (runs in its own process) ------------------------------------------------------
class TrivialReplica:
    """A Serve replica whose "engine" is the trivial backend at ``url`` (what the gate dials), with
    a canned KV reading, and a ``call`` method for calls made through the Serve handle."""

    def __init__(self, url: str, chunks: int) -> None:
        from ray import serve

        self.rid = serve.get_replica_context().replica_id.unique_id
        self.url = url
        self.payload = b"data: {}\n\n" * chunks + b"data: [DONE]\n\n"
        self.seq = 0

    def record_routing_stats(self) -> dict:
        self.seq += 1
        return {"replica": self.rid, "url": self.url, "seq": self.seq,
                "telemetry": {"free_blocks": 95000, "total_blocks": 100000, "block_size": 16, "kv_usage": 0.05}}

    async def call(self, path, body, headers, method="POST", mars_replica=None):
        return self.rid, 200, [(b"content-type", b"text/event-stream")], self.payload


async def _handle_cost(handle, n: int, concurrency: int) -> float:
    """CPU ms of this process per call made through the Serve handle (what a gate would pay if its
    calls went through Ray rather than over HTTP)."""
    import time

    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            await handle.call.remote("/v1/chat/completions", b"{}", [])

    await asyncio.gather(*(one() for _ in range(20)))  # warm the router
    c0 = time.process_time()
    await asyncio.gather(*(one() for _ in range(n)))
    return (time.process_time() - c0) * 1e3 / n


def run_ray_gate(port: int, backend_url: str, chunks: int, clients: int, handle_out: str) -> None:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from vllm_mars import serve_ray
    from vllm_mars.admission.sidecar import SidecarConfig
    from vllm_mars.admission.sidecar.serving import serve_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20)
    serve.start(proxy_location="Disabled")
    dep = serve.deployment(TrivialReplica, name=serve_ray.DEPLOYMENT, num_replicas=2,
                           ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=4 * clients,
                           request_router_config=RequestRouterConfig(
                               request_router_class="vllm_mars.serve_ray.router.MarsRouter",
                               request_routing_stats_period_s=serve_ray.STATS_PERIOD_S))
    handle = serve.run(dep.bind(backend_url, chunks), name="mars", route_prefix=None, blocking=False)
    Path(handle_out).write_text(json.dumps({"handle_cpu_ms_per_call": asyncio.run(_handle_cost(handle, 300, 16))}))
    cfg = SidecarConfig(backends=("http://unused",), controller="mars", port=port,
                        controller_options={"window_min": clients, "window_max": clients})
    try:
        serve_app(serve_ray.gate_for(handle, cfg))
    finally:
        serve_ray.stop()


# -- the benchmark ----------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="16,64,256", help="closed-loop client counts (default 16,64,256)")
    ap.add_argument("--chunks", type=int, default=16, help="SSE chunks per answer (default 16)")
    ap.add_argument("--duration", type=float, default=4.0, help="measured seconds per phase (default 4)")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per phase (default 1)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating direct/ingress rounds (default 3)")
    ap.add_argument("--ray", action="store_true", help="also measure the Ray ingress (needs vllm-mars[ray])")
    ap.add_argument("--record", action="store_true", help="write results/ingress_throughput.json")
    ap.add_argument("--role", default="bench", choices=("bench", "raygate"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--clients-max", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="", help=argparse.SUPPRESS)
    ap.add_argument("--handle-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "raygate":
        run_ray_gate(args.port, args.backend, args.chunks, args.clients_max, args.handle_out)
        return 0
    levels = [int(x) for x in args.levels.split(",")]
    top = max(levels)
    rate = paper_call_rate()
    print(f"paper call rate per replica: {rate['calls_per_s_per_replica']} calls/s ({rate['from']}, {rate['grid']})",
          flush=True)

    bport = so._free_port()
    burl = f"http://127.0.0.1:{bport}"
    procs = {"backend": subprocess.Popen([sys.executable, str(HERE / "sidecar_overhead.py"), "--role", "backend",
                                          "--port", str(bport), "--chunks", str(args.chunks), "--chunk-ms", "0"])}
    ingresses: dict[str, str] = {}
    try:
        so._wait(burl)
        sport = so._free_port()
        procs["sidecar"] = subprocess.Popen(
            [sys.executable, "-m", "vllm_mars.cli", "sidecar", "--backend", burl, "--port", str(sport),
             "--controller", "mars", "--controller-option", f"window_min={top}",
             "--controller-option", f"window_max={top}"])
        ingresses["sidecar"] = f"http://127.0.0.1:{sport}"
        if args.ray:
            rport = so._free_port()
            handle_out = Path(tempfile.mkdtemp()) / "handle.json"
            procs["ray"] = subprocess.Popen([sys.executable, __file__, "--role", "raygate", "--port", str(rport),
                                             "--backend", burl, "--chunks", str(args.chunks),
                                             "--clients-max", str(top), "--handle-out", str(handle_out)])
            ingresses["ray"] = f"http://127.0.0.1:{rport}"
        for url in ingresses.values():
            so._wait(url, timeout=240)
        if args.ray:  # the gate answers /health before the router has reported the replicas
            asyncio.run(so.load(ingresses["ray"], 2, 2.0, 0.0))
        results: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in ["direct", *ingresses]}
        for rnd in range(args.rounds):
            for clients in levels:
                for name, url in [("direct", burl), *ingresses.items()]:
                    proc = procs["backend"] if name == "direct" else procs[name]
                    cpu0 = so._cpu_s(proc.pid)
                    res = asyncio.run(so.load(url, clients, args.duration, args.warmup))
                    cpu1 = so._cpu_s(proc.pid)
                    n_all = max(1.0, res["completed_rps"] * (args.duration + args.warmup))
                    res["cpu_ms_per_call"] = (cpu1 - cpu0) * 1e3 / n_all
                    res["cpu_util"] = (cpu1 - cpu0) / (args.duration + args.warmup)
                    results[name][clients].append(res)
                    print(f"round {rnd} clients {clients:4d} {name:8s} {res['throughput_rps']:8.1f} calls/s  "
                          f"p50 {res['p50_ms']:8.2f} ms  p99 {res['p99_ms']:8.2f} ms  "
                          f"cpu/call {res['cpu_ms_per_call']:.3f} ms  util {res['cpu_util']:.2f}", flush=True)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def med(name: str, clients: int, key: str) -> float:
        return round(statistics.median(r[key] for r in results[name][clients]), 3)

    def added(name: str, clients: int, key: str) -> float:
        pairs = zip(results[name][clients], results["direct"][clients], strict=True)
        return round(statistics.median(i[key] - d[key] for i, d in pairs), 3)

    summary: dict = {}
    for name in ingresses:
        rows = []
        for c in levels:
            rows.append({"clients": c, "calls_per_s": med(name, c, "throughput_rps"),
                         "direct_calls_per_s": med("direct", c, "throughput_rps"),
                         "p50_ms": med(name, c, "p50_ms"), "p99_ms": med(name, c, "p99_ms"),
                         "added_p50_ms": added(name, c, "p50_ms"), "added_p99_ms": added(name, c, "p99_ms"),
                         "cpu_ms_per_call": med(name, c, "cpu_ms_per_call"), "cpu_util": med(name, c, "cpu_util")})
        cpu = statistics.median(r["cpu_ms_per_call"] for r in rows)
        per_core = 1000.0 / cpu
        summary[name] = {"levels": rows, "cpu_ms_per_call": round(cpu, 3),
                         "calls_per_s_one_core": round(per_core, 1),
                         "best_measured_calls_per_s": max(r["calls_per_s"] for r in rows),
                         "replicas_served": int(per_core // rate["calls_per_s_per_replica"])}
    if args.ray:
        summary["ray"]["handle_cpu_ms_per_call"] = round(json.loads(handle_out.read_text())["handle_cpu_ms_per_call"], 3)
    out = {"summary": summary, "paper_rate": rate,
           "params": {"levels": levels, "chunks": args.chunks, "duration_s": args.duration, "rounds": args.rounds},
           "date": dt.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
           "load_avg": os.getloadavg(), "rounds": {k: {str(c): v for c, v in d.items()} for k, d in results.items()}}
    print(json.dumps({"summary": summary, "paper_rate": rate}, indent=1))
    if args.record:
        (HERE / "results").mkdir(exist_ok=True)
        (HERE / "results" / "ingress_throughput.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
