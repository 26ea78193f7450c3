"""Scheduler overhead: microseconds per schedule() + update_from_output() cycle, MarsScheduler
with each policy vs vLLM's stock Scheduler, in one process, at (running, waiting) points.

Each point brings both schedulers to the same steady state (``running`` decoding requests,
``waiting`` queued ones that cannot start because max_num_seqs is reached), then times cycles in
alternating blocks (stock, ours, stock, ours, ...) so machine noise hits both alike. Reports the
median per-cycle time over the repeats and the ratio ours / stock.

    .venv/bin/python benchmark/perf/sched_overhead.py                 # every registered policy
    .venv/bin/python benchmark/perf/sched_overhead.py --policies fcfs,mars --record
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
POINTS = ((32, 0), (256, 0), (256, 1000))


def _build(policy: str | None, running: int, waiting: int, options: dict | None = None):
    from vllm_mars.engine.rig import fake_model_output, make_request, make_scheduler

    s = make_scheduler(policy or "fcfs", stock=policy is None, policy_options=options,
                       num_blocks=24000, block_size=16,
                       max_num_seqs=max(running, 1), max_num_batched_tokens=16384, max_model_len=8192)
    for i in range(running):
        s.add_request(make_request(f"run{i}", prompt_len=64, max_tokens=7000, workflow=f"w{i}", turn=0,
                                   tool="bash", seed=i * 131))
    # Prefill everyone, so the timed cycles are steady-state decode steps.
    for _ in range(4):
        so = s.schedule()
        s.update_from_output(so, fake_model_output(s, so))
    for j in range(waiting):
        s.add_request(make_request(f"wait{j}", prompt_len=64, max_tokens=16, workflow=f"v{j}", turn=0,
                                   seed=10_000 + j))
    assert len(s.running) == running, (len(s.running), running)
    return s


#: The timer: this thread's CPU time (default; a box shared with other jobs inflates it much less
#: than wall time) or wall time.
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
_timer = CLOCKS["cpu"]


def _time_cycles(s, cycles: int) -> float:
    from vllm_mars.engine.rig import fake_model_output

    t0 = _timer()
    for _ in range(cycles):
        so = s.schedule()
        s.update_from_output(so, fake_model_output(s, so))
    return (_timer() - t0) / cycles * 1e6


def _fake_output_cost(s, cycles: int) -> float:
    """The rig's fake model output is not scheduler work: measure it to subtract it."""
    from vllm_mars.engine.rig import fake_model_output

    so = s.schedule()
    t0 = _timer()
    for _ in range(cycles):
        fake_model_output(s, so)
    dt_us = (_timer() - t0) / cycles * 1e6
    s.update_from_output(so, fake_model_output(s, so))
    return dt_us


def measure(policy: str, running: int, waiting: int, repeats: int, cycles: int,
            options: dict | None = None) -> dict:
    stock = _build(None, running, waiting)
    ours = _build(policy, running, waiting, options)
    base, mine = [], []
    gc.disable()
    try:
        _time_cycles(stock, 3)
        _time_cycles(ours, 3)
        for _ in range(repeats):
            base.append(_time_cycles(stock, cycles))
            mine.append(_time_cycles(ours, cycles))
        fake = statistics.median(_fake_output_cost(stock, cycles) for _ in range(3))
    finally:
        gc.enable()
    b = statistics.median(base) - fake
    m = statistics.median(mine) - fake
    return {"stock_us": round(b, 1), "mars_us": round(m, 1), "ratio": round(m / b, 3)}


def _insert_rows(path: Path, rows: list[str]) -> None:
    """Insert rows at the end of this benchmark's table in RESULTS.md (other sections may follow)."""
    text = path.read_text().splitlines()
    header = next(i for i, line in enumerate(text) if line.startswith("| date | policy | ratio (32, 0)"))
    end = header + 1
    while end < len(text) and text[end].startswith("|"):
        end += 1
    path.write_text("\n".join(text[:end] + rows + text[end:]) + "\n")


def main() -> None:
    from vllm_mars.policies import available_policies

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default=",".join(available_policies()),
                    help="comma-separated policies (default: every registered one)")
    ap.add_argument("--repeats", type=int, default=7, help="alternating timed blocks per side (default 7)")
    ap.add_argument("--cycles", type=int, default=30, help="cycles per timed block (default 30)")
    ap.add_argument("--out", default=str(HERE / "results" / "sched_overhead.json"))
    ap.add_argument("--policy-options", default="{}",
                    help='JSON {policy: {option: value}}; e.g. lightllm needs {"lightllm": '
                         '{"router_token_ratio": 1.0}} to admit 256 long decodes at all')
    ap.add_argument("--points", default=",".join(f"{r}x{w}" for r, w in POINTS),
                    help="(running x waiting) points, e.g. 256x1000 (default: all three)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: this thread's CPU time (default); wall: perf_counter")
    ap.add_argument("--record", action="store_true", help="append a dated row per policy to RESULTS.md")
    args = ap.parse_args()
    global _timer
    _timer = CLOCKS[args.clock]
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",") if p]
    if args.record and sorted(points) != sorted(POINTS):
        raise SystemExit("--record needs every point (leave --points at its default)")
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in available_policies()]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; available: {', '.join(available_policies())}")

    options = json.loads(args.policy_options)
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise SystemExit('--policy-options must be a JSON object {"policy": {"option": value}}')
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    for policy in policies:
        row = {}
        for running, waiting in points:
            r = measure(policy, running, waiting, args.repeats, args.cycles, options.get(policy))
            row[f"ratio_{running}_{waiting}"] = r["ratio"]
            row[f"us_{running}_{waiting}"] = {"stock": r["stock_us"], "mars": r["mars_us"]}
            print(f"{policy:16s} running={running:4d} waiting={waiting:5d}  stock {r['stock_us']:9.1f} us"
                  f"  mars {r['mars_us']:9.1f} us  ratio {r['ratio']:.3f}", flush=True)
        row["date"] = dt.date.today().isoformat()
        results[policy] = row
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    if args.record:
        cmd = "python benchmark/perf/sched_overhead.py --policies " + ",".join(policies)
        if options:
            cmd += f" --policy-options '{args.policy_options}'"
        cmd += " --record"
        lines = [f"| {dt.date.today().isoformat()} | {policy} | {results[policy]['ratio_32_0']:.3f} | "
                 f"{results[policy]['ratio_256_0']:.3f} | {results[policy]['ratio_256_1000']:.3f} | "
                 f"{results[policy]['us_256_1000']['stock']:.0f} / {results[policy]['us_256_1000']['mars']:.0f} | "
                 f"{platform.machine()} `{cmd}` |" for policy in policies]
        _insert_rows(HERE / "RESULTS.md", lines)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
