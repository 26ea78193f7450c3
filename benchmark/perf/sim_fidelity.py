"""Sim fidelity: one workload through the real CPU engine (tiny model, wall time) and through the sim
(virtual time, a CPU profile fitted on this machine), for each policy; errors of the sim's metrics.

    PYTHONPATH=vllm-mars python benchmark/perf/sim_fidelity.py                 # fit a profile now, then run
    PYTHONPATH=vllm-mars python benchmark/perf/sim_fidelity.py --profile cpu-tiny --policies fcfs,mars

Steps: (1) `mars profile` on the CPU engine (the `cpu` grid) unless --profile is given; (2) per policy,
`mars replay --backend inprocess --record-steps` (the real engine; its steps are timed); (3) the same
replay with `--backend sim` and the grid-fitted profile (the engine shape of the real run: same KV
blocks, block size and limits); (4) the same again with a profile fitted to the real runs' own
recorded steps (`mars profile --from-steps`: one profile for all policies' runs, and one per policy to
its own run), which separates the step-time model's error (and a shared machine's changing load) from
the scheduling simulation's; (5) with --real-repeat, a second real run per policy: the real-vs-real
spread is the noise floor of the comparison. Writes results/sim_fidelity.json:
``{"fcfs": {"mean_e2e_err": ..., ...}, "mars": {...}, "_winner": {...}, "_meta": {...}}``; errors
are (sim - real) / real, prefix-hit error is sim - real (a difference of rates).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmark" / "perf" / "results" / "sim_fidelity.json"


def metrics(summary: dict) -> dict:
    return {"mean_e2e_s": summary["e2e_s"]["mean"], "p95_e2e_s": summary["e2e_s"]["p95"],
            "mean_ttft_s": summary["ttft_s"]["mean"], "preemptions": summary.get("preemptions") or 0,
            "recomputed_tokens": summary.get("recomputed_tokens") or 0,
            "prefix_hit_rate": summary.get("prefix_hit_rate"), "completed": summary.get("completed"),
            "makespan_s": summary.get("makespan_s")}


def rel(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else None
    return round((sim - real) / real, 4)


def errors(real: dict, sim: dict) -> dict:
    out = {"mean_e2e_err": rel(sim["mean_e2e_s"], real["mean_e2e_s"]),
           "p95_e2e_err": rel(sim["p95_e2e_s"], real["p95_e2e_s"]),
           "mean_ttft_err": rel(sim["mean_ttft_s"], real["mean_ttft_s"]),
           "preemptions_err": rel(sim["preemptions"], real["preemptions"]),
           "recomputed_tokens_err": rel(sim["recomputed_tokens"], real["recomputed_tokens"])}
    if sim["prefix_hit_rate"] is not None and real["prefix_hit_rate"] is not None:
        out["prefix_hit_rate_diff"] = round(sim["prefix_hit_rate"] - real["prefix_hit_rate"], 4)
    return out


def fit_grid_profile(out: Path, grid: str, repeats: int | None) -> Path:
    """`mars profile` now, on this machine (the CPU engine with the tiny model)."""
    from vllm_mars.cli import main as mars

    path = out / "cpu-tiny-grid.toml"
    argv = ["profile", "--grid", grid, "--out", str(path), "--samples-out", str(out / "grid_steps.jsonl")]
    if repeats:
        argv += ["--repeats", str(repeats)]
    if mars(argv) != 0:
        raise SystemExit("mars profile failed")
    return path


def shaped(profile: str, cfg, dest: Path) -> Path:
    """The profile with the real run's engine shape (KV blocks, block size, limits)."""
    from vllm_mars.sim.profile import load_profile

    p = load_profile(profile)
    p = p.with_efficiency(p.efficiency, model=p.model_dir(), num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                          max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens)
    return p.write(dest)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="fcfs,mars")
    ap.add_argument("--workload", default=str(ROOT / "benchmark" / "workloads" / "compact.jsonl"))
    ap.add_argument("--num-workflows", type=int, default=None)
    ap.add_argument("--rps", type=float, default=4.0)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="a fitted CPU profile (default: fit one now)")
    ap.add_argument("--grid", default="cpu", help="grid of the fit when --profile is not given")
    ap.add_argument("--grid-repeats", type=int, default=None)
    ap.add_argument("--no-self-fit", action="store_true", help="skip the sim runs with the self-fitted profiles")
    ap.add_argument("--real-repeat", action="store_true",
                    help="run the real engine twice per policy: the real-vs-real spread is the noise floor")
    ap.add_argument("--out", default=None, help="work dir (default runs/sim_fidelity_<stamp>); a rerun with the same "
                    "dir reuses its finished real runs and grid fit")
    ap.add_argument("--results", default=str(RESULTS), help="JSON results file ('' = do not write)")
    args = ap.parse_args(argv)

    from vllm_mars.driver.runner import ReplayConfig, run_replay

    out = Path(args.out or f"runs/sim_fidelity_{time.strftime('%Y%m%d_%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    load0 = os.getloadavg()
    grid_fit = out / "cpu-tiny-grid.toml"
    profile = args.profile or (str(grid_fit) if grid_fit.exists() else str(fit_grid_profile(out, args.grid,
                                                                                             args.grid_repeats)))
    base = ReplayConfig(workload=args.workload, num_workflows=args.num_workflows, rps=args.rps, seed=args.seed,
                        num_blocks=args.num_blocks, progress=False)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    grid_profile = shaped(profile, base, out / "profile-grid.toml")
    real, sim, sim_self = {}, {}, {}
    real2 = {}
    for pol in policies:
        for tag in ("", "-r2") if args.real_repeat else ("",):
            d = out / f"real-{pol}{tag}"
            if not ((d / "summary.json").exists() and (d / "steps.jsonl").exists()):  # resumable
                cfg = replace(base, policy=pol, backend="inprocess", record_steps=True, out=str(d))
                d, _ = run_replay(cfg)
            (real2 if tag else real)[pol] = metrics(json.loads((d / "summary.json").read_text()))
        print(f"real {pol}: {real[pol]}", file=sys.stderr)
    for pol in policies:
        cfg = replace(base, policy=pol, backend="sim", profile=str(grid_profile), out=str(out / f"sim-{pol}"))
        d, _ = run_replay(cfg)
        sim[pol] = metrics(json.loads((d / "summary.json").read_text()))
    sim_own = {}
    if not args.no_self_fit:
        from vllm_mars.cli import main as mars

        def fit_steps(name: str, pols: list[str]) -> Path:
            path = out / f"cpu-tiny-{name}.toml"
            steps = [str(out / f"real-{pol}" / "steps.jsonl") for pol in pols]
            if mars(["profile", "--from-steps", *steps, "--out", str(path)]) != 0:
                raise SystemExit("mars profile --from-steps failed")
            return shaped(str(path), base, out / f"profile-{name}.toml")

        # one profile fitted to every policy's recorded steps, and one per policy to its own run's steps
        self_profile = fit_steps("self", policies)
        for pol in policies:
            cfg = replace(base, policy=pol, backend="sim", profile=str(self_profile), out=str(out / f"simself-{pol}"))
            d, _ = run_replay(cfg)
            sim_self[pol] = metrics(json.loads((d / "summary.json").read_text()))
            own = fit_steps(f"own-{pol}", [pol])
            d, _ = run_replay(replace(cfg, profile=str(own), out=str(out / f"simown-{pol}")))
            sim_own[pol] = metrics(json.loads((d / "summary.json").read_text()))

    def winner(m: dict) -> str:
        return min(m, key=lambda p: m[p]["mean_e2e_s"])

    result: dict = {}
    for pol in policies:
        result[pol] = {**errors(real[pol], sim[pol]), "real": real[pol], "sim": sim[pol]}
        if sim_self:
            result[pol]["self_fit"] = {**errors(real[pol], sim_self[pol]), "sim": sim_self[pol]}
            result[pol]["own_run_fit"] = {**errors(real[pol], sim_own[pol]), "sim": sim_own[pol]}
        if real2:
            result[pol]["real_repeat"] = {**errors(real[pol], real2[pol]), "real": real2[pol]}
    result["_winner"] = {"real": winner(real), "sim": winner(sim), "same": winner(real) == winner(sim)}
    if sim_self:
        result["_winner"]["sim_self_fit"] = winner(sim_self)
    result["_meta"] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0)), "machine": f"{platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})",
        "loadavg_start": [round(x, 1) for x in load0], "loadavg_end": [round(x, 1) for x in os.getloadavg()],
        "command": "PYTHONPATH=vllm-mars python benchmark/perf/sim_fidelity.py " + " ".join(argv or sys.argv[1:]),
        "workload": args.workload, "rps": args.rps, "num_blocks": args.num_blocks, "profile": profile,
        "wall_s": round(time.time() - t0, 1), "work_dir": str(out)}
    print(json.dumps(result, indent=2))
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
