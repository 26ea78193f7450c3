"""Where a simulated run's admission CPU goes: the MARS controller's ticks and selections, the queue
they weigh, and the projection's work for it, during one ``mars replay --backend sim`` run (the
workload and settings of ``sim_speed.py``: ILR-3, mars, 0.16 roots/s, H200 profile, seed 0).

    PYTHONPATH=<tree>/vllm-mars python benchmark/perf/admission_ticks.py --workflows 200 [--out f.json]

Reports ticks (those with roots queued, their mean and largest queue), selections (ticks with a
free slot: ``_select``), admissions, the roots the selections weighed (the controller's ``weighed``
counter where the tree has it, else every queued root at every selection), and calls and CPU time
(``time.process_time`` around each call, ~1 us a wrapped call, so small calls read high) of the
tick, the selection and the projection's methods. Times whichever ``vllm_mars`` it imports: run it
again with ``PYTHONPATH`` at another checkout to compare, in the same session.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workflows", type=int, default=200)
    ap.add_argument("--rps", type=float, default=0.16)
    ap.add_argument("--preset", default="ILR-3")
    ap.add_argument("--profile", default="h200-qwen3-coder-30b-a3b")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm_mars.engine.rig  # noqa: F401 - vLLM's import is start-up, not simulation
    from vllm_mars.admission.mars import MarsAdmissionController, projection, selection
    from vllm_mars.driver.runner import ReplayConfig, run_replay
    from vllm_mars.workload.ilr import generate, load_preset
    from vllm_mars.workload.schema import write_workload

    calls: dict[str, list] = {}

    def wrap(owner, name: str, label: str) -> None:
        f = getattr(owner, name)
        calls[label] = [0, 0.0]

        def timed(*a, **k):
            t = time.process_time()
            try:
                return f(*a, **k)
            finally:
                rec = calls[label]
                rec[0] += 1
                rec[1] += time.process_time() - t

        setattr(owner, name, timed)

    counts = {"ticks": 0, "ticks_queued": 0, "queued_sum": 0, "queued_max": 0, "selections": 0,
              "selection_queue_sum": 0, "admitted": 0}
    ctrl: list = []
    C = MarsAdmissionController
    orig_tick, orig_select = C.tick, C._select

    def tick(self, now):
        if not ctrl or ctrl[-1] is not self:
            ctrl.append(self)
        counts["ticks"] += 1
        q = len(self._queue)
        if q:
            counts["ticks_queued"] += 1
            counts["queued_sum"] += q
            counts["queued_max"] = max(counts["queued_max"], q)
        return orig_tick(self, now)

    def select(self, slots, budget, now):
        counts["selections"] += 1
        counts["selection_queue_sum"] += len(self._queue)
        out = orig_select(self, slots, budget, now)
        counts["admitted"] += len(out)
        return out

    C.tick, C._select = tick, select
    wrap(C, "tick", "tick")
    wrap(C, "_select", "_select")
    for name in ("peak_with", "marginal_overflow", "pool_keeps", "peak"):
        wrap(projection.LifeView, name, f"LifeView.{name}")
    wrap(selection, "fit_wait_s", "fit_wait_s")
    wrap(selection, "rebuild_s_total", "rebuild_s_total")

    tmp = Path(tempfile.mkdtemp(prefix="mars-admission-ticks-"))
    wl = tmp / "w.jsonl"
    write_workload(wl, generate(load_preset(args.preset, num_workflows=args.workflows, seed=0)))
    cfg = ReplayConfig(workload=str(wl), policy="mars", rps=args.rps, backend="sim", profile=args.profile, seed=0,
                       progress=False, plots=False, out=str(tmp / "run"))
    t = time.process_time()
    out, _ = run_replay(cfg)
    total = time.process_time() - t
    summary = json.loads((out / "summary.json").read_text())
    weighed = sum(getattr(c, "weighed", 0) for c in ctrl) if any(hasattr(c, "weighed") for c in ctrl) \
        else counts["selection_queue_sum"]
    rec = {"workflows": args.workflows, "run_cpu_s": round(total, 2), "virtual_s": round(summary["wall_s"], 1),
           "steps": summary["engine"]["steps"], **counts, "weighed": weighed,
           "calls": {k: {"calls": n, "cpu_s": round(s, 2), "us_per_call": round(1e6 * s / max(n, 1), 1),
                         "share": round(s / total, 4)} for k, (n, s) in calls.items()}}
    print(json.dumps({k: v for k, v in rec.items() if k != "calls"}))
    for k, r in rec["calls"].items():
        print(f"{r['cpu_s']:8.2f} s {100 * r['share']:5.1f} %  {r['calls']:>9} calls  {r['us_per_call']:9.1f} us/call  {k}")
    if args.out:
        Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
