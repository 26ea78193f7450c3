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
``[variants.LABEL]``: default ``experiments/cpu_default_queue_wait.toml``).

    .venv/bin/python benchmark/perf/cpu_default_rounds.py --rounds 5
    .venv/bin/python benchmark/perf/cpu_default_rounds.py --variants fcfs,mars --rounds 9 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


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
    return 0


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="fcfs,mars,mars-queue-wait-slot,mars-queue-wait-fit",
                    help="comma-separated driver policies or variant labels (fcfs is the baseline and always runs)")
    ap.add_argument("--variants-from", default=str(REPO / "experiments" / "cpu_default_queue_wait.toml"),
                    help="experiment file whose [variants.LABEL] tables define the variant labels")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-steal", type=float, default=0.02,
                    help="a round is quiet when no run in it lost more than this share of CPU time to steal")
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_default_rounds.json"))
    ap.add_argument("--summarize", metavar="FILE",
                    help="run nothing: print the paired speedups of an earlier --out file (its rounds)")
    args = ap.parse_args(argv)
    if args.summarize:
        return _summarize(ap, args.summarize)
    if args.rounds < 1:
        ap.error("--rounds: must be >= 1")
    if not 0 <= args.max_steal <= 1:
        ap.error("--max-steal: must be in [0, 1]")

    from vllm_mars.cli import build_parser
    from vllm_mars.commands.driver import _quiet_engine, compare_config
    from vllm_mars.driver.compare import DEFAULT_RPS, policy_config
    from vllm_mars.driver.runner import run_replay

    labels, variants = resolve_variants(ap, args.variants, args.variants_from)

    cargs = build_parser().parse_args(["compare", "--no-progress"])
    _quiet_engine(cargs)
    base, _ = compare_config(cargs)
    base = base.with_profile()
    rps = DEFAULT_RPS[0]
    cost = None
    rounds = []
    with tempfile.TemporaryDirectory(prefix="mars-rounds-") as tmp:
        for r in range(args.rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            row = {}
            for label in order:
                cfg = policy_config(base, label, variants.get(label), rps=rps, out=str(Path(tmp) / f"r{r}" / label))
                all0, st0 = _cpu_jiffies()
                run_dir, cost = run_replay(cfg, cost)
                all1, st1 = _cpu_jiffies()
                s = json.loads((Path(run_dir) / "summary.json").read_text())
                adm = s.get("admission") or {}
                row[label] = {"mean_e2e_s": s["e2e_s"]["mean"], "goodput_alpha3": s["goodput_wps"].get("3.0"),
                              "makespan_s": s["makespan_s"], "mean_admission_wait_s": (adm.get("wait_s") or {}).get("mean"),
                              "steal_share": round((st1 - st0) / max(1, all1 - all0), 4)}
                print(f"round {r} {label:22s} mean E2E {row[label]['mean_e2e_s']:6.2f} s  "
                      f"steal {row[label]['steal_share']:.1%}", flush=True)
            rounds.append({"order": order, "runs": row})

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
        "variants": {k: variants.get(k, {"policy": k}) for k in labels}, "rps": rps, "max_steal": args.max_steal,
        "cost_model": cost.as_dict() if cost else None, "rounds": rounds,
        "median_speedup_vs_fcfs": medians(rounds), "quiet_rounds": len(quiet),
        "median_speedup_vs_fcfs_quiet": medians(quiet),
        "speedup_vs_fcfs": intervals(rounds),
    }
    dest = Path(args.out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(record, indent=2) + "\n")
    print(f"median speedup vs fcfs, all {len(rounds)} rounds: {record['median_speedup_vs_fcfs']}")
    print(f"... quiet rounds ({len(quiet)}): {record['median_speedup_vs_fcfs_quiet']}")
    for label, iv in record["speedup_vs_fcfs"].items():
        print_interval(label, iv)
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
