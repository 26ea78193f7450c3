"""Speed of the virtual-time engine: virtual seconds simulated per wall (and CPU) second.

Generates an ILR-3 workload (``mars gen-workload --preset ILR-3``: 24k-64k-token initial contexts,
4-20 turns, weka-fitted tool times), replays it with ``mars replay --backend sim`` on a shipped
GPU profile (default H200 + Qwen3-Coder-30B-A3B: a ~726k-token KV pool, about ten ILR-3
contexts), and reports the run's virtual duration over its wall time and over its CPU time. The
CPU figure is what a quiet 2-core box would see as wall time (the run is one thread); on a shared
box wall time is inflated by the load, so both are recorded with the load average.

``--cprofile`` adds where the time goes, grouped: vLLM's scheduler and KV cache manager, the rest
of vLLM, our engine adapter, policies, driver, admission, metrics, sim, asyncio.

    .venv/bin/python benchmark/perf/sim_speed.py                          # 200 workflows, mars, 0.1 roots/s
    .venv/bin/python benchmark/perf/sim_speed.py --workflows 40 --policy fcfs --cprofile
    .venv/bin/python benchmark/perf/sim_speed.py --record                 # writes results/sim_speed.json
    .venv/bin/python benchmark/perf/sim_speed.py --workflows 30 --policy fcfs --rps 0.08 --kv-scale 10

``--workflows`` takes a list (``20,200,400``): one run per size, in one process, so growth with scale
is visible; ``--baseline`` runs each size a second time with the sim's decode fast-forward off
(``SimBackend.fast_forward = False``: every step through vLLM's schedule/update), side by side, and
checks that both runs wrote byte-identical ``summary.json`` and ``events.jsonl``.

    .venv/bin/python benchmark/perf/sim_speed.py --workflows 20,200,400 --rps 0.16 --baseline 20,200 --record

The script times whichever ``vllm_mars`` it imports: against another revision's sim, run it again
with ``PYTHONPATH`` at that checkout's ``vllm-mars`` (side by side, in the same session).

``--floor`` also times, per run, the CPU inside vLLM's own ``schedule()`` and ``update_from_output()``
on the steps the fast-forward leaves to the full path (arrivals, finishes, preemptions, starts) and
inside the fast-forward itself: ``virtual_s`` over the first is the best virtual/CPU reachable while
the sim runs vLLM's real scheduler on those steps (``floor_virtual_per_cpu``).

    .venv/bin/python benchmark/perf/sim_speed.py --workflows 400 --floor

The record also counts the replay engine's empty steps and the calibration engine's steps, which
call ``schedule()`` too. ``--floor-cprofile FILE`` profiles only those calls (pstats in
``FILE.<workflows>``; cProfile's per-call cost overstates call-heavy code: ``sim_costs.py`` gives
the split).

``--kv-scale`` runs on a pool that many times the profile's (the step times stay the profile's): the
cost of a huge pool (``max_rss_mb`` is the process's peak resident memory, vLLM's import included).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import functools
import json
import os
import platform
import pstats
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GROUPS = (("vllm/v1/core", "vllm scheduler + KV cache manager"), ("site-packages/vllm/", "vllm other"),
          ("vllm_mars/engine", "mars engine adapter"), ("vllm_mars/policies", "mars policies"),
          ("vllm_mars/driver", "driver"), ("vllm_mars/admission", "admission"),
          ("vllm_mars/metrics", "metrics + report"), ("vllm_mars/sim", "sim engine + profile"),
          ("vllm_mars/workload", "workload"), ("asyncio", "asyncio"), ("matplotlib", "plots"))


def grouped(stats: pstats.Stats) -> dict[str, float]:
    """Own (tottime) seconds per group of source files."""
    out: dict[str, float] = {}
    for (path, _, _), (_, _, tottime, _, _) in stats.stats.items():
        name = next((label for key, label in GROUPS if key in path), "other")
        out[name] = out.get(name, 0.0) + tottime
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class _Timed:
    """CPU time inside chosen methods while installed (outermost call counted once), for ``--floor``."""

    def __init__(self, profile: cProfile.Profile | None = None) -> None:
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list = []
        #: profiles the timed calls only (``--floor-cprofile``)
        self.profile = profile

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Time ``owner.name`` (a class's method or a module's function) under ``label``."""
        own = name in vars(owner)
        f = vars(owner)[name] if own else getattr(owner, name)
        binder = None
        if isinstance(f, (classmethod, staticmethod)):
            binder, f = type(f), f.__func__
        self.cpu[label], self.calls[label] = 0.0, 0
        depth = [0]
        cpu, calls = self.cpu, self.calls
        prof = self.profile

        @functools.wraps(f)
        def timed(*a, **k):
            if depth[0]:
                return f(*a, **k)
            depth[0] = 1
            t = time.process_time()
            if prof is not None:
                prof.enable()
            try:
                return f(*a, **k)
            finally:
                if prof is not None:
                    prof.disable()
                depth[0] = 0
                cpu[label] += time.process_time() - t
                calls[label] += 1

        setattr(owner, name, timed if binder is None else binder(timed))
        self._undo.append((owner, name, (f if binder is None else binder(f)) if own else None))

    def undo(self) -> None:
        for owner, name, f in reversed(self._undo):
            if f is None:
                delattr(owner, name)  # (it was inherited)
            else:
                setattr(owner, name, f)
        self._undo.clear()


def run_one(args, workflows: int, fast: bool, tmp: Path) -> tuple[dict, Path]:
    """One replay; its speed record and its output dir."""
    from vllm_mars.driver.runner import ReplayConfig, run_replay
    from vllm_mars.engine.scheduler import MarsSchedulerMixin
    from vllm_mars.sim.engine import SimBackend
    from vllm_mars.workload.ilr import generate, load_preset
    from vllm_mars.workload.schema import write_workload

    wl = tmp / f"{args.preset.lower()}-{workflows}.jsonl"
    if not wl.exists():
        write_workload(wl, generate(load_preset(args.preset, num_workflows=workflows, seed=args.seed)))
    cfg = ReplayConfig(workload=str(wl), policy=args.policy, rps=args.rps, backend="sim", profile=args.profile,
                       seed=args.seed, kv_scale=args.kv_scale, progress=False,
                       out=str(tmp / f"run-{workflows}-{'ff' if fast else 'noff'}"))
    SimBackend.fast_forward = fast
    backends = []
    start = SimBackend.start

    async def recording_start(self):
        backends.append(self)
        return await start(self)

    SimBackend.start = recording_start
    inner = cProfile.Profile() if args.floor_cprofile else None
    timed = _Timed(inner) if args.floor or inner else None
    if timed is not None:
        # the full path: vLLM's schedule() (with the policy's end of step) and update_from_output()
        timed.wrap(MarsSchedulerMixin, "_mars_schedule_begun", "full_path_schedule")
        timed.wrap(MarsSchedulerMixin, "update_from_output", "full_path_update")
    prof = cProfile.Profile() if args.cprofile else None
    load0 = os.getloadavg()[0]
    t, c = time.monotonic(), time.process_time()
    if prof:
        prof.enable()
    try:
        out, _ = run_replay(cfg)
    finally:
        if prof:
            prof.disable()
        SimBackend.fast_forward = True
        SimBackend.start = start
        if timed is not None:
            timed.undo()
    wall, cpu = time.monotonic() - t, time.process_time() - c
    summary = json.loads((out / "summary.json").read_text())
    virtual = summary["wall_s"]  # the run's duration on its (virtual) clock
    rec = {
        "workflows": workflows, "fast_forward": fast, "load_avg_start": round(load0, 1),
        "load_avg_end": round(os.getloadavg()[0], 1), "num_blocks": summary["engine"]["num_blocks"],
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "virtual_s": round(virtual, 1), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
        "virtual_per_wall": round(virtual / wall, 1), "virtual_per_cpu": round(virtual / cpu, 1),
        "completed": summary["completed"], "steps": summary["engine"]["steps"],
        "mean_e2e_s": round(summary["e2e_s"]["mean"], 1), "preemptions": summary["preemptions"],
        "prefix_hit_rate": round(summary["prefix_hit_rate"], 3), "out": str(out),
    }
    run = max(backends, key=lambda b: b.steps)  # the replay's engine (not a calibration engine)
    rec.update({k: getattr(run, k) for k in ("ff_steps", "ff_waiting", "ff_prefill", "ff_crossed", "ff_bulk")
                if hasattr(run, k)})
    if timed is not None:
        full = timed.cpu["full_path_schedule"] + timed.cpu["full_path_update"]
        # schedule()/update_from_output() run on every full-path step and every empty step (nothing
        # scheduled: the engine idles) of every engine of the run: the replay's and the driver's
        # calibration engines (a few short calls on a fresh engine each)
        others = [b for b in backends if b is not run]
        rec["floor"] = {
            "full_path_steps": run.steps - run.ff_steps, "idle_steps": run.idle_steps,
            "calibration_engines": len(others),
            "calibration_full_path_steps": sum(b.steps - b.ff_steps + b.idle_steps for b in others),
            **{f"{k}_cpu_s": round(v, 2) for k, v in timed.cpu.items()},
            "full_path_schedule_calls": timed.calls["full_path_schedule"],
            "full_path_update_calls": timed.calls["full_path_update"],
            "full_path_cpu_s": round(full, 2), "full_path_share": round(full / cpu, 3),
            "floor_virtual_per_cpu": round(virtual / full, 1) if full else None,
        }
    if inner is not None:
        inner.dump_stats(f"{args.floor_cprofile}.{workflows}")
        print(f"full-path steps' profile: {args.floor_cprofile}.{workflows}")
        pstats.Stats(inner).sort_stats("tottime").print_stats(40)
    if prof:
        stats = pstats.Stats(prof)
        rec["cprofile_own_s"] = {k: round(v, 2) for k, v in grouped(stats).items()}
        stats.sort_stats("tottime").print_stats(25)
    print(json.dumps(rec), flush=True)
    return rec, out


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workflows", default="200", help="workflows per run; a comma list runs each size")
    ap.add_argument("--baseline", default="", help="sizes to run again with the fast-forward off (comma list)")
    ap.add_argument("--preset", default="ILR-3")
    ap.add_argument("--policy", default="mars")
    ap.add_argument("--rps", type=float, default=0.16, help="roots/s (0.16: the paper grid's heaviest ILR-3 load)")
    ap.add_argument("--profile", default="h200-qwen3-coder-30b-a3b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-scale", type=float, default=None, help="KV pool = this x the profile's (default: the profile's)")
    ap.add_argument("--cprofile", action="store_true", help="also report where the time goes (slower)")
    ap.add_argument("--floor", action="store_true",
                    help="also time vLLM's schedule()/update_from_output() on the full-path steps (the floor)")
    ap.add_argument("--floor-cprofile", default="", metavar="FILE",
                    help="--floor with cProfile inside those calls only; pstats to FILE.<workflows>")
    ap.add_argument("--record", action="store_true", help="write results/sim_speed.json")
    ap.add_argument("--out", default=str(HERE / "results" / "sim_speed.json"))
    args = ap.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm_mars.engine.rig  # noqa: F401 - vLLM's import (seconds) is start-up, not simulation

    tmp = Path(tempfile.mkdtemp(prefix="mars-sim-speed-"))
    baseline = set(_sizes(args.baseline))
    runs, identical = [], {}
    for n in _sizes(args.workflows):
        rec, out = run_one(args, n, True, tmp)
        runs.append(rec)
        if n in baseline:
            base, base_out = run_one(args, n, False, tmp)
            runs.append(base)
            identical[n] = all((out / f).read_bytes() == (base_out / f).read_bytes()
                               for f in ("summary.json", "events.jsonl"))
            rec["speedup_cpu_vs_no_fast_forward"] = round(base["cpu_s"] / rec["cpu_s"], 2)
            rec["identical_to_no_fast_forward"] = identical[n]
    record = {
        "date": dt.date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
        "preset": args.preset, "policy": args.policy, "rps": args.rps, "profile": args.profile,
        "kv_scale": args.kv_scale, "seed": args.seed,
        "virtual_per_cpu": {str(r["workflows"]): r["virtual_per_cpu"] for r in runs if r["fast_forward"]},
        "runs": runs,
        "note": "wall time on a 2-core VM shared with other jobs (load avg given); cpu_s is the run's own CPU "
                "time (one thread), about the wall time of a quiet box; fast_forward false = the sim's decode "
                "fast-forward off (the baseline), run in the same process right after",
        "command": "python benchmark/perf/sim_speed.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k in ("workflows", "baseline", "policy", "rps", "profile", "preset", "kv_scale") and v not in (None, "")),
    }
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=2))
    if args.record:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    if not all(identical.values()):
        raise SystemExit(f"fast-forward on and off differ: {identical}")


if __name__ == "__main__":
    main()
