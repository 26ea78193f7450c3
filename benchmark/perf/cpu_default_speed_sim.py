"""The embedded default in virtual time, at several engine step speeds, over many seeds.

On the real CPU engine the embedded default (`mars compare`: the bundled compact workload, the tiny
model, 48 KV blocks of 32 tokens, 4 roots/s) gives mars anything from 0.8x to 1.7x fcfs, because the
VM's speed moves between runs (steal bursts) and with it the step time against the fixed tool
times. Here the same setup runs through `--backend sim` with a step-time profile fitted to that
engine's own recorded steps, scaled to several speeds (``Profile.with_step_scale``), with Poisson
arrivals so that each seed is a different arrival sequence: per scale and variant, the geometric
mean over seeds of fcfs's mean E2E over the variant's (the speedup), a 90 % bootstrap interval of
it, and in how many seeds the variant was faster. No noise from the box: the same command gives the
same numbers.

    .venv/bin/python benchmark/perf/cpu_default_speed_sim.py
    .venv/bin/python benchmark/perf/cpu_default_speed_sim.py --scales 0.5,1 --seeds 4 --variants fcfs,mars --out /tmp/s.json

A label is a driver policy (``mars policies``) or a variant of ``--variants-from`` (an experiment
file's ``[variants.LABEL]``, default ``experiments/studies/cpu_default_aimd.toml``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

# this directory's other script
from cpu_default_rounds import check_stretch, paired_summary, resolve_variants, run_record, stretch_workload

DEFAULT_PROFILE = HERE / "results" / "life" / "cpu_tiny_steps_20261202.toml"


def _run(job: tuple[str, str, dict, int, str, float, str | None]) -> tuple[str, str, int, dict]:
    """One sim replay (in a worker process): (scale, label, seed, its summary's figures)."""
    scale, label, variant, seed, profile, rps, workload = job
    from dataclasses import replace

    from vllm_mars.driver.compare import policy_config
    from vllm_mars.driver.runner import ReplayConfig, run_replay

    with tempfile.TemporaryDirectory(prefix="mars-speed-") as tmp:
        base = ReplayConfig(backend="sim", profile=profile, num_blocks=48, arrival="poisson", seed=seed,
                            progress=False, plots=False).with_profile()
        if workload:
            base = replace(base, workload=workload)
        cfg = policy_config(base, label, variant, rps=rps, out=str(Path(tmp) / "run"))
        run_dir, _ = run_replay(cfg)
        s = json.loads((Path(run_dir) / "summary.json").read_text())
        row = {**run_record(Path(run_dir)), "p95_e2e_s": s["e2e_s"]["p95"], "prefix_hit_rate": s.get("prefix_hit_rate")}
    return scale, label, seed, row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE),
                    help="step-time profile of the CPU engine (name or file; default: the fit of 2026-12-02)")
    ap.add_argument("--scales", default="0.5,0.7,1.0", help="comma-separated step-time factors (1 = the profile)")
    ap.add_argument("--seeds", type=int, default=10, help="Poisson arrival seeds 0..N-1 (default 10)")
    ap.add_argument("--variants", default="fcfs,mars,mars-queue-wait-slot,mars-no-admission,mars-queue-wait-fit",
                    help="comma-separated driver policies or variant labels (fcfs is the baseline and always runs)")
    ap.add_argument("--variants-from", default=str(REPO / "experiments" / "studies" / "cpu_default_aimd.toml"))
    ap.add_argument("--rps", type=float, default=4.0)
    ap.add_argument("--stretch", type=float, default=1.0,
                    help="slow the workload's clock by this factor (every tool time and arrival gap x K, rps / K), "
                         "as `cpu_default_rounds.py --stretch` does on the real engine: with the profile of that "
                         "engine and scale 1, the same regime, the controller's and driver's periods included")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_default_speed_sim.json"))
    args = ap.parse_args(argv)

    from vllm_mars.sim.profile import load_profile

    try:
        scales = [float(x) for x in args.scales.split(",") if x.strip()]
        if not scales or any(not x > 0 for x in scales):
            raise ValueError("every scale must be > 0")
    except ValueError as e:
        ap.error(f"--scales {args.scales!r}: {e}")
    if args.seeds < 1:
        ap.error("--seeds: must be >= 1")
    if args.jobs < 1:
        ap.error("--jobs: must be >= 1")
    if not args.rps > 0:
        ap.error("--rps: must be > 0")
    check_stretch(ap, args.stretch)
    try:
        prof = load_profile(args.profile)
    except (ValueError, OSError) as e:
        ap.error(f"--profile: {e}")
    labels, variants = resolve_variants(ap, args.variants, args.variants_from)

    with tempfile.TemporaryDirectory(prefix="mars-speed-prof-") as tmp:
        paths = {}
        for f in scales:
            paths[f"{f:g}"] = str(prof.with_step_scale(f).write(Path(tmp) / f"x{f:g}.toml"))
        workload = None
        if args.stretch != 1:
            from vllm_mars.driver.runner import ReplayConfig

            workload = str(stretch_workload(ReplayConfig().workload, Path(tmp) / "stretched.jsonl", args.stretch))
        rps = args.rps / args.stretch
        jobs = [(sc, label, variants.get(label), seed, path, rps, workload)
                for sc, path in paths.items() for seed in range(args.seeds) for label in labels]
        runs: dict[str, dict[str, dict[int, dict]]] = {}
        t0 = time.monotonic()
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for n, (sc, label, seed, row) in enumerate(pool.map(_run, jobs), 1):
                runs.setdefault(sc, {}).setdefault(label, {})[seed] = row
                print(f"[{n}/{len(jobs)}] x{sc} seed {seed} {label:22s} mean E2E {row['mean_e2e_s']:7.3f} s",
                      flush=True)

    table = {}
    for sc, by_label in runs.items():
        fc = by_label["fcfs"]
        table[sc] = {"fcfs_mean_e2e_s": round(statistics.mean(r["mean_e2e_s"] for r in fc.values()), 4)}
        for label in labels:
            if label == "fcfs":
                continue
            rows = by_label[label]
            ratios = [fc[s]["mean_e2e_s"] / rows[s]["mean_e2e_s"] for s in sorted(rows)]
            waits = [r["mean_admission_wait_s"] for r in rows.values() if r["mean_admission_wait_s"] is not None]
            table[sc][label] = {**paired_summary(ratios), "mean_admission_wait_s":
                                round(statistics.mean(waits), 4) if waits else None}
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU (virtual time: the box does not matter)",
        "command": "python benchmark/perf/cpu_default_speed_sim.py " + " ".join(argv),
        "profile": args.profile, "rps": rps, "stretch": args.stretch, "seeds": args.seeds,
        "variants": {k: variants.get(k, {"policy": k}) for k in labels},
        "wall_s": round(time.monotonic() - t0, 1), "speedup_vs_fcfs": table, "runs": runs,
    }
    dest = Path(args.out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(record, indent=2) + "\n")
    print("\n| step scale | fcfs mean E2E (s) | " + " | ".join(f"{x} vs fcfs" for x in labels if x != "fcfs") + " |")
    print("|---|---|" + "---|" * (len(labels) - 1))
    for sc, row in table.items():
        cells = [f"{row[x]['geomean']:.3f}x ({row[x]['ci90'][0]:.3f}-{row[x]['ci90'][1]:.3f}; "
                 f"{row[x]['faster']}/{row[x]['rounds']})" for x in labels if x != "fcfs"]
        print(f"| {sc} | {row['fcfs_mean_e2e_s']:.3f} | " + " | ".join(cells) + " |")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
