"""CPU cost of the MARS admission controller's own work, alone (no engine, no sidecar):

* ``arrival``: the sidecar's pattern (``benchmark/perf/sidecar_overhead.py``): ``--active`` one-call
  roots in flight, each new call a new root: offer + tick, its prompt seen (``update_estimate``),
  its end (``finish`` + tick); the footprint rule (the sidecar has no cost model), "life" sizing. Reported per
  arrival.
* ``tick``: the sim's pattern at a thrash cell: ``--active`` multi-turn roots and ``--queued`` roots
  waiting, the cost rule with a cost model, telemetry every tick, a few active roots showing a new
  turn between ticks (``--turns-per-tick``); every queued root is priced at every tick. Reported per
  tick.

Times whichever ``vllm_mars`` it imports: against another revision, run it again with ``PYTHONPATH``
at that checkout's ``vllm-mars``, in the same session. Medians of ``--repeats`` (CPU time).

    PYTHONPATH=vllm-mars .venv/bin/python benchmark/perf/admission_select.py
    PYTHONPATH=vllm-mars .venv/bin/python benchmark/perf/admission_select.py --active 64 --queued 150
    PYTHONPATH=vllm-mars .venv/bin/python benchmark/perf/admission_select.py --cases arrival --active 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from vllm_mars.admission.base import PendingRoot, Telemetry
from vllm_mars.admission.mars import MarsAdmissionConfig, MarsAdmissionController
from vllm_mars.costmodel import CostModel


def arrival_us(active: int, n: int) -> float:
    """CPU microseconds per arrival (offer, tick, prompt seen, finish, tick) with ``active`` in flight."""
    c = MarsAdmissionController(MarsAdmissionConfig(window_min=active, window_max=active, admit="footprint"))
    rng = random.Random(0)
    total = 100_000
    c.observe(Telemetry(ts=0.0, free_blocks=total // 2, total_blocks=total, block_size=16, running=active))
    live: list[str] = []
    t = 0.0
    for i in range(active):
        c.offer(PendingRoot(f"p{i}", t, rng.randrange(200, 4000)))
        live += c.tick(t)
    t0 = time.process_time()
    for i in range(n):
        t += 0.001
        if i % 50 == 0:
            c.observe(Telemetry(ts=t, free_blocks=total // 2 - rng.randrange(0, 1000), total_blocks=total,
                                block_size=16, running=active))
        wf = f"r{i}"
        c.finish(live.pop(0), t, final_tokens=rng.randrange(300, 5000), turns=1)
        c.tick(t)
        c.offer(PendingRoot(wf, t, rng.randrange(200, 4000)))
        live += c.tick(t)
        if c.is_active(wf):
            c.update_estimate(wf, rng.randrange(4000, 5000), t)
    return (time.process_time() - t0) / n * 1e6


def tick_us(active: int, queued: int, n: int, turns_per_tick: int) -> float:
    """CPU microseconds per tick with ``active`` roots in, ``queued`` waiting (the cost rule)."""
    c = MarsAdmissionController(MarsAdmissionConfig(window_max=active + 8))  # window_min: the default
    c.set_cost_model(CostModel(prefill_s_per_token=2e-5, attn_s_per_token_ctx=1e-10, source="bench"))
    rng = random.Random(1)
    total = 45_000  # a ~726k-token pool in 16-token blocks, the H200 profile's
    c.observe(Telemetry(ts=0.0, free_blocks=total, total_blocks=total, block_size=16, running=0,
                        recomputed_tokens=0, kv_blocks_removed=0))
    for i in range(active):
        c.offer(PendingRoot(f"a{i}", 0.0, rng.randrange(24_000, 64_000), {"turns": rng.randrange(4, 21)}))
    c.tick(0.0)
    for i in range(queued):
        c.offer(PendingRoot(f"q{i}", 0.0, rng.randrange(24_000, 64_000), {"turns": rng.randrange(4, 21)}))
    act = [f"a{i}" for i in range(active)]
    ctx = {w: c._active[w].prefill_tokens for w in act}
    t, spent, priced = 0.0, 0.0, 0
    for i in range(n):
        t += 0.2
        c.observe(Telemetry(ts=t, free_blocks=rng.randrange(0, 200), total_blocks=total, block_size=16,
                            running=rng.randrange(active // 2, active), recomputed_tokens=0, kv_blocks_removed=0))
        for w in rng.sample(act, turns_per_tick):
            ctx[w] += rng.randrange(500, 3000)
            c.update_estimate(w, ctx[w], t)
        t0 = time.process_time()
        admitted = c.tick(t)
        spent += time.process_time() - t0
        for w in admitted:  # in and out again: the queue stays as long, the active set as large
            c.finish(w, t, final_tokens=80_000, turns=10)
            c.offer(PendingRoot(f"{w}+", t, rng.randrange(24_000, 64_000), {"turns": rng.randrange(4, 21)}))
        priced += c.num_queued
    assert priced >= n * queued // 2, "the queue drained: the case no longer prices every root"
    return spent / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--active", type=int, default=64)
    ap.add_argument("--queued", type=int, default=150)
    ap.add_argument("--arrivals", type=int, default=5000)
    ap.add_argument("--ticks", type=int, default=300)
    ap.add_argument("--turns-per-tick", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default="arrival,tick", help="comma-separated: arrival, tick")
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    if not cases or not cases <= {"arrival", "tick"}:
        ap.error(f"--cases: {args.cases!r}: allowed arrival, tick (comma-separated)")
    out: dict = {"active": args.active, "queued": args.queued, "turns_per_tick": args.turns_per_tick}
    if "arrival" in cases:
        arr = [arrival_us(args.active, args.arrivals) for _ in range(args.repeats)]
        out.update(arrival_us_median=round(statistics.median(arr), 1), arrival_us=[round(x, 1) for x in arr])
    if "tick" in cases:
        tick = [tick_us(args.active, args.queued, args.ticks, args.turns_per_tick) for _ in range(args.repeats)]
        out.update(tick_us_median=round(statistics.median(tick), 1), tick_us=[round(x, 1) for x in tick])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
