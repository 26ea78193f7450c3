"""The embedded default (`mars compare`'s setup) in alternating rounds, with the VM's steal time.

Each round runs every variant once on README command 1's setup (the bundled compact workload, the
tiny CPU model, 48 KV blocks of 32 tokens, 4 roots/s), the order rotated by one per round so no
variant always runs first or last; one process, one calibrated cost model for all runs. Around every
run it reads the CPU time the hypervisor stole from this VM (/proc/stat), because on a shared host a
burst of steal moves one run's wall time by 10-80 % while the box looks idle. Reports per round each
variant's mean E2E over fcfs's (the speedup), and the medians over all rounds and over the quiet ones
(no run in the round with more than ``--max-steal`` of its CPU time stolen), and per variant the
geometric mean of the per-round speedups with a 90 % bootstrap interval (``--summarize FILE`` prints
those for an earlier output without running anything). A label is a driver
policy (``mars policies``) or a variant of ``--variants-from`` (an experiment file's
``[variants.LABEL]``: default ``experiments/studies/cpu_default_aimd.toml``).

With ``--concurrent`` the variants of a round run at the same time instead, each in its own process
pinned to its own core (at most one variant per core), so the steal bursts and the box's speed
changes that move one sequential run against the next hit both runs of a pair alike; each engine
then has one core, a slower regime than the sequential runs' two. Every run records its steps, and
``step_speed`` (its recorded step seconds over what the fitted CPU profile predicts for the same
batches) shows how alike the pair's engines ran.

    .venv/bin/python benchmark/perf/cpu_default_rounds.py --rounds 5
    .venv/bin/python benchmark/perf/cpu_default_rounds.py --variants fcfs,mars --rounds 9 --out /tmp/r.json
    .venv/bin/python benchmark/perf/cpu_default_rounds.py --variants fcfs,mars --concurrent --rounds 12

``--stretch K`` slows the workload's clock K times (every tool time and arrival gap x K, tokens
unchanged): against its tools the engine then runs as if K times faster, so a box whose steps take
2.2x the fitted profile's measures the regime of step speed 2.2 / K (the sim rig's step scale,
``cpu_default_speed_sim.py``). Not exact: the driver's and the controller's own periods (telemetry
sampling, control interval, retention's fixed bounds) stay in wall seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: the step-time profile fitted to this engine's recorded steps (the ``step_speed`` reference)
STEP_PROFILE = HERE / "results" / "life" / "cpu_tiny_steps_20261202.toml"


def _cpu_jiffies() -> tuple[int, int]:
    """(all CPU jiffies, stolen jiffies) since boot, over every CPU of this VM."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    steal = fields[7] if len(fields) > 7 else 0
    return sum(fields[:8]), steal


def paired_summary(ratios: list[float], resamples: int = 4000, seed: int = 0) -> dict:
    """Per-round speedups (fcfs / variant, same round) summarised: their geometric mean, a 90 %
    percentile-bootstrap interval of it (rounds resampled with replacement, fixed seed), and in how
    many rounds the variant was faster. A ratio is paired within its round, so slow spells of the
    box that hit both runs of a round cancel; what is left is the run-to-run noise the interval shows."""
    if not ratios:
        return {"rounds": 0, "geomean": None, "ci90": [None, None], "faster": 0}
    logs = [math.log(x) for x in ratios]
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(sum(rng.choice(logs) for _ in range(n)) / n for _ in range(resamples))
    lo, hi = means[int(0.05 * (resamples - 1))], means[int(0.95 * (resamples - 1))]
    return {"rounds": n, "geomean": round(math.exp(sum(logs) / n), 4),
            "ci90": [round(math.exp(lo), 4), round(math.exp(hi), 4)], "faster": sum(1 for x in ratios if x > 1)}


def speed_adjusted(pairs: list[tuple[float, float]]) -> dict | None:
    """Per-round (speedup, fcfs's step speed over the variant's) pairs: the speedup at equal step
    speed, the intercept of a least-squares line of log speedup on log speed ratio, with a 90 %
    normal interval. Within a concurrent pair the two engines still ran at different speeds (one
    core hosts the parent process; a policy's batch mix fits the profile differently); this takes
    that out. None with fewer than 3 rounds or no spread in the speed ratios."""
    if len(pairs) < 3:
        return None
    ys = [math.log(r) for r, _ in pairs]
    xs = [math.log(v) for _, v in pairs]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - slope * mx
    resid = sum((y - a - slope * x) ** 2 for x, y in zip(xs, ys)) / max(n - 2, 1)
    se = math.sqrt(resid * (1 / n + mx * mx / sxx))
    return {"rounds": n, "speedup": round(math.exp(a), 4), "ci90": [round(math.exp(a - 1.645 * se), 4),
            round(math.exp(a + 1.645 * se), 4)], "slope": round(slope, 3), "mean_speed_ratio": round(math.exp(mx), 4)}


def _speed_pairs(rounds: list[dict], label: str) -> list[tuple[float, float]]:
    out = []
    for x in rounds:
        f, v = x["runs"]["fcfs"], x["runs"][label]
        if f.get("step_speed") and v.get("step_speed"):
            out.append((f["mean_e2e_s"] / v["mean_e2e_s"], f["step_speed"] / v["step_speed"]))
    return out


def print_adjusted(label: str, adj: dict | None) -> None:
    """One line of :func:`speed_adjusted` (nothing when it is None)."""
    if adj:
        print(f"{label}: at equal step speed {adj['speedup']}x, 90% CI {adj['ci90'][0]}-{adj['ci90'][1]}x "
              f"(log speedup on log step-speed ratio over {adj['rounds']} rounds, slope {adj['slope']}; "
              f"mean step-speed ratio fcfs/{label} {adj['mean_speed_ratio']})")


def print_interval(label: str, iv: dict) -> None:
    """One line of :func:`paired_summary`."""
    print(f"{label}: geometric mean {iv['geomean']}x, 90% CI {iv['ci90'][0]}-{iv['ci90'][1]}x "
          f"(bootstrap over {iv['rounds']} paired rounds), faster in {iv['faster']} of {iv['rounds']}")


def resolve_variants(ap: argparse.ArgumentParser, names: str, variants_from: str) -> tuple[list[str], dict]:
    """``--variants`` and ``--variants-from`` checked: (labels, fcfs first if missing; the file's
    variant tables). A label must be a variant of the file or a driver policy; else a usage error."""
    from vllm_mars.driver.control import check_policy
    from vllm_mars.experiment.spec import ExperimentError, load_experiment

    try:
        variants = load_experiment(variants_from).variants
    except (ExperimentError, OSError) as e:
        ap.error(f"--variants-from: {e}")
    labels = [x.strip() for x in names.split(",") if x.strip()]
    if "fcfs" not in labels:
        labels.insert(0, "fcfs")
    for label in labels:
        if label not in variants:
            try:
                check_policy(label)
            except ValueError as e:
                ap.error(f"--variants: {label!r} is neither a variant of {variants_from} "
                         f"({', '.join(variants) or 'none'}) nor a driver policy: {e}")
    return labels, variants


#: the clock stretches a workload may take (``--stretch``, ``sim_fidelity.py``'s ``compact:K``)
STRETCH_RANGE = (0.1, 100.0)


def stretch_in_range(k: float) -> bool:
    """Whether ``k`` is a clock stretch in :data:`STRETCH_RANGE` (False for NaN)."""
    return STRETCH_RANGE[0] <= k <= STRETCH_RANGE[1]


def check_stretch(ap: argparse.ArgumentParser, k: float) -> None:
    """``--stretch``'s range, for this script and the sim rig's."""
    if not stretch_in_range(k):
        ap.error(f"--stretch: must be in [{STRETCH_RANGE[0]:g}, {STRETCH_RANGE[1]:g}], got {k:g}")


def stretch_workload(src: str, dest: Path, k: float) -> Path:
    """``src`` with its clock slowed ``k`` times: every turn's ``tool_s`` and every ``arrival_s`` x k
    (children included), the tokens unchanged; written to ``dest`` and loaded back (validated)."""
    from vllm_mars.workload.schema import load_workload

    def scale(wf: dict) -> None:
        for turn in wf.get("turns", []):
            if turn.get("tool_s"):
                turn["tool_s"] = round(turn["tool_s"] * k, 6)
        if wf.get("arrival_s") is not None:
            wf["arrival_s"] = round(wf["arrival_s"] * k, 6)
        for child in wf.get("children", []):
            scale(child["workflow"])

    lines = []
    for line in Path(src).read_text().splitlines():
        if line.strip():
            wf = json.loads(line)
            scale(wf)
            lines.append(json.dumps(wf, separators=(",", ":")))
    dest.write_text("\n".join(lines) + "\n")
    load_workload(dest)
    return dest


def run_record(run_dir: Path) -> dict:
    """A run's figures for the record, from its summary.json (callers add their own: steal share,
    step speed, the sim rig's p95 and prefix hit rate)."""
    s = json.loads((run_dir / "summary.json").read_text())
    adm = s.get("admission") or {}
    row = {"mean_e2e_s": s["e2e_s"]["mean"], "goodput_alpha3": s["goodput_wps"].get("3.0"),
           "makespan_s": s["makespan_s"], "mean_admission_wait_s": (adm.get("wait_s") or {}).get("mean"),
           "preemptions": s.get("preemptions")}
    state = (s.get("engine") or {}).get("policy_state")
    if state:
        row["policy_state"] = state  # the policy's adaptive state at the end (mars_stats)
    return row


def _step_speed(steps_file: Path) -> float | None:
    """The run's recorded steps against the fitted CPU profile (``vllm_mars.sim.fit.step_speed``);
    None when nothing was recorded."""
    from vllm_mars.sim.fit import load_samples, step_speed
    from vllm_mars.sim.profile import load_profile

    try:
        return round(step_speed(load_profile(str(STEP_PROFILE)), load_samples(str(steps_file))), 4)
    except (OSError, ValueError):
        return None


def _concurrent_run(job: tuple) -> tuple[str, dict, object]:
    """One run of a concurrent round, in its own process pinned to core ``core``: (label, its
    figures, the cost model it used)."""
    label, cfg, core, cost, keep = job
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from dataclasses import replace

    from vllm_mars.driver.runner import run_replay

    run_dir, cost = run_replay(replace(cfg, cpu_gpu=str(core), record_steps=True), cost)
    steps = Path(run_dir) / "steps.jsonl"
    if keep and steps.is_file():
        shutil.copyfile(steps, keep)
    return label, {**run_record(Path(run_dir)), "step_speed": _step_speed(steps)}, cost


def _summarize(ap: argparse.ArgumentParser, path: str) -> int:
    try:
        record = json.loads(Path(path).read_text())
        rounds = record["rounds"]
        labels = [k for k in rounds[0]["runs"] if k != "fcfs"]
        per = {k: [x["runs"]["fcfs"]["mean_e2e_s"] / x["runs"][k]["mean_e2e_s"] for x in rounds] for k in labels}
    except (OSError, ValueError, KeyError, IndexError, TypeError, ZeroDivisionError) as e:
        ap.error(f"--summarize {path}: not an output of this script ({type(e).__name__}: {e})")
    for label, vals in per.items():
        print_interval(label, paired_summary(vals))
        print_adjusted(label, speed_adjusted(_speed_pairs(rounds, label)))
    return 0


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="fcfs,mars,mars-queue-wait-slot,mars-queue-wait-fit",
                    help="comma-separated driver policies or variant labels (fcfs is the baseline and always runs)")
    ap.add_argument("--variants-from", default=str(REPO / "experiments" / "studies" / "cpu_default_aimd.toml"),
                    help="experiment file whose [variants.LABEL] tables define the variant labels")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-steal", type=float, default=0.02,
                    help="a round is quiet when no run in it lost more than this share of CPU time to steal")
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_default_rounds.json"))
    ap.add_argument("--concurrent", action="store_true",
                    help="run a round's variants at the same time, one process pinned to one core each")
    ap.add_argument("--stretch", type=float, default=1.0,
                    help="slow the workload's clock by this factor: every tool time and arrival gap x K (the "
                         "engine as if K times faster against its tools; a slow box's fast regime)")
    ap.add_argument("--keep-steps", metavar="DIR",
                    help="with --concurrent: copy every run's recorded steps to DIR/r<round>_<label>.jsonl (the "
                         "input of `mars profile --from-steps`, to fit this box's own profile)")
    ap.add_argument("--cost-model", metavar="FILE",
                    help="price every run with this cost model (CostModel JSON or a step-time profile, as "
                         "`mars serve --cost-model`) instead of the solo-call calibration: the policies, the "
                         "admission controller and T_ideal")
    ap.add_argument("--summarize", metavar="FILE",
                    help="run nothing: print the paired speedups of an earlier --out file (its rounds)")
    args = ap.parse_args(argv)
    if args.summarize:
        return _summarize(ap, args.summarize)
    if args.rounds < 1:
        ap.error("--rounds: must be >= 1")
    if not 0 <= args.max_steal <= 1:
        ap.error("--max-steal: must be in [0, 1]")
    check_stretch(ap, args.stretch)
    if args.keep_steps and not args.concurrent:
        ap.error("--keep-steps: only with --concurrent (the sequential runs record no steps)")
    keep_dir = Path(args.keep_steps) if args.keep_steps else None
    if keep_dir is not None:
        try:
            keep_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--keep-steps {keep_dir}: {e}")
    given_cost = None
    if args.cost_model:
        from vllm_mars.sim.profile import load_cost_model

        try:
            given_cost = load_cost_model(args.cost_model)
        except (OSError, ValueError) as e:
            ap.error(f"--cost-model {args.cost_model}: {e}")
    cores = sorted(os.sched_getaffinity(0))

    from dataclasses import replace

    from vllm_mars.cli import build_parser
    from vllm_mars.commands.driver import _quiet_engine, compare_config
    from vllm_mars.driver.compare import DEFAULT_RPS, policy_config
    from vllm_mars.driver.runner import run_replay

    labels, variants = resolve_variants(ap, args.variants, args.variants_from)
    if args.concurrent and len(labels) > len(cores):
        ap.error(f"--concurrent: {len(labels)} variants ({', '.join(labels)}) but {len(cores)} usable cores; "
                 "one variant per core")

    cargs = build_parser().parse_args(["compare", "--no-progress"])
    _quiet_engine(cargs)
    base, _ = compare_config(cargs)
    base = base.with_profile()
    rps = DEFAULT_RPS[0] / args.stretch
    cost = given_cost
    rounds = []
    with tempfile.TemporaryDirectory(prefix="mars-rounds-") as tmp:
        if args.stretch != 1:
            base = replace(base, workload=str(stretch_workload(base.workload, Path(tmp) / "stretched.jsonl",
                                                               args.stretch)))
        pool = ProcessPoolExecutor(max_workers=len(labels), mp_context=get_context("spawn")) if args.concurrent else None
        try:
            for r in range(args.rounds):
                order = labels[r % len(labels):] + labels[:r % len(labels)]
                cfgs = {label: policy_config(base, label, variants.get(label), rps=rps,
                                             out=str(Path(tmp) / f"r{r}" / label)) for label in order}
                row = {}
                if pool is not None:
                    # all at once; the core a variant gets rotates with the order
                    all0, st0 = _cpu_jiffies()
                    done = list(pool.map(_concurrent_run, [
                        (label, cfgs[label], cores[i], cost,
                         str(keep_dir / f"r{r}_{label}.jsonl") if keep_dir is not None else None)
                        for i, label in enumerate(order)]))
                    all1, st1 = _cpu_jiffies()
                    steal = round((st1 - st0) / max(1, all1 - all0), 4)
                    for label, fig, run_cost in done:
                        row[label] = {**fig, "steal_share": steal}
                        cost = cost or run_cost  # later rounds use the first calibration
                else:
                    for label in order:
                        all0, st0 = _cpu_jiffies()
                        run_dir, cost = run_replay(cfgs[label], cost)
                        all1, st1 = _cpu_jiffies()
                        row[label] = {**run_record(Path(run_dir)), "steal_share": round((st1 - st0) / max(1, all1 - all0), 4)}
                for label in order:
                    speed = row[label].get("step_speed")
                    print(f"round {r} {label:22s} mean E2E {row[label]['mean_e2e_s']:6.2f} s  "
                          f"steal {row[label]['steal_share']:.1%}" + (f"  step speed {speed:.3f}" if speed else "")
                          + (f" (/ stretch {speed / args.stretch:.3f})" if speed and args.stretch != 1 else ""),
                          flush=True)
                rounds.append({"order": order, "runs": row})
        finally:
            if pool is not None:
                pool.shutdown()

    def ratios(rows: list[dict], label: str) -> list[float]:
        return [x["runs"]["fcfs"]["mean_e2e_s"] / x["runs"][label]["mean_e2e_s"] for x in rows]

    def medians(rows: list[dict]) -> dict[str, float | None]:
        out = {}
        for label in labels:
            if label == "fcfs":
                continue
            vals = ratios(rows, label)
            out[label] = round(statistics.median(vals), 4) if vals else None
        return out

    def intervals(rows: list[dict]) -> dict[str, dict]:
        return {label: paired_summary(ratios(rows, label)) for label in labels if label != "fcfs"}

    quiet = [x for x in rounds if max(v["steal_share"] for v in x["runs"].values()) <= args.max_steal]
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU",
        "command": "python benchmark/perf/cpu_default_rounds.py " + " ".join(argv),
        "mode": "concurrent (one core per run)" if args.concurrent else "sequential",
        "stretch": args.stretch,
        "variants": {k: variants.get(k, {"policy": k}) for k in labels}, "rps": rps, "max_steal": args.max_steal,
        "cost_model": cost.as_dict() if cost else None, "rounds": rounds,
        "median_speedup_vs_fcfs": medians(rounds), "quiet_rounds": len(quiet),
        "median_speedup_vs_fcfs_quiet": medians(quiet),
        "speedup_vs_fcfs": intervals(rounds),
        "speedup_vs_fcfs_at_equal_step_speed": {label: speed_adjusted(_speed_pairs(rounds, label))
                                                for label in labels if label != "fcfs"},
    }
    dest = Path(args.out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(record, indent=2) + "\n")
    print(f"median speedup vs fcfs, all {len(rounds)} rounds: {record['median_speedup_vs_fcfs']}")
    print(f"... quiet rounds ({len(quiet)}): {record['median_speedup_vs_fcfs_quiet']}")
    for label, iv in record["speedup_vs_fcfs"].items():
        print_interval(label, iv)
        print_adjusted(label, record["speedup_vs_fcfs_at_equal_step_speed"][label])
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
