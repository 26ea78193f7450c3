"""The tables of this README from results.json (run from the repo root with PYTHONPATH=vllm-mars):

    python experiments/paper/results/fig10_h200/tables.py [--only GLOB,...]

Per run (per cell and policy): mean / P90 / P95 E2E, preemptions, recomputed tokens, context blocks
rebuilt (figure 3A's count), KV use max / mean, admission wait, makespan. Per cell and seed: mars's
speedup over the fastest baseline per statistic (the fastest of that statistic). Per load level with
two or more seeds: over the fastest of the baselines run in every one of its seeds, the geometric mean
over the seeds and its 95 % interval (Student's t on the log speedups:
vllm_mars.experiment.summary.seed_interval, as `mars experiment summary --groups`)."""

from __future__ import annotations

import argparse
import fnmatch
import json
from collections import defaultdict
from pathlib import Path

from vllm_mars.experiment.summary import seed_interval
from vllm_mars.metrics.compare import is_baseline

HERE = Path(__file__).resolve().parent
STATS = ("mean_e2e_s", "p90_e2e_s", "p95_e2e_s")


def rebuilt(d: dict) -> int | None:
    """Figure 3A's count: the context blocks a workflow's next call did not find cached, over all bins."""
    bins = (d.get("figure") or {}).get("kv_removed_by_progress")
    return None if bins is None else int(sum(bins))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="*")
    args = ap.parse_args()
    rec = json.loads((HERE / "results.json").read_text())
    variants = rec["config"]["variants"]
    cells = [c for c in rec["cells"] if any(fnmatch.fnmatchcase(c["key"], g) for g in args.only.split(","))]
    print("| cell | seed | policy | mean / P90 / P95 E2E (s) | preemptions | recomputed tokens | context blocks "
          "rebuilt | KV use max / mean | admission wait (s) | makespan (s) | done |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        for p, d in c["policies"].items():
            rb = rebuilt(d)
            print(f"| {c['workload']} @ {c['rps']:g} | {c['seed']} | {p} | "
                  + " / ".join(f"{d[s]:.1f}" for s in STATS)
                  + f" | {d['preemptions']} | {d['recomputed_tokens']:,} | {'-' if rb is None else f'{rb:,}'} | "
                  f"{d['kv_usage_max']:.2f} / {d['kv_usage_mean']:.2f} | {d['mean_admission_wait_s'] or 0:.1f} | "
                  f"{d['makespan_s']:.0f} | {d['completed']}/{d['workflows']} |")
    print()
    print("| cell | seed | mars mean / P90 / P95 (s) | fastest baseline per statistic | speedup mean / P90 / P95 |")
    print("|---|---|---|---|---|")
    by_level: dict[tuple[str, float], list[tuple[dict, dict]]] = defaultdict(list)
    for c in cells:
        m = c["policies"].get("mars")
        base = {p: d for p, d in c["policies"].items() if is_baseline(p, (variants.get(p) or {}).get("policy"))}
        if not m or not base:
            continue
        by_level[(c["workload"], c["rps"])].append((m, base))
        best = {s: min(base, key=lambda p: base[p][s]) for s in STATS}
        names = " / ".join(f"{best[s]} {base[best[s]][s]:.1f}" for s in STATS)
        print(f"| {c['workload']} @ {c['rps']:g} | {c['seed']} | " + " / ".join(f"{m[s]:.1f}" for s in STATS)
              + f" | {names} | " + " / ".join(f"{base[best[s]][s] / m[s]:.2f}x" for s in STATS) + " |")
    print()
    # over the seeds: the fastest of the baselines run in every seed of the level (a baseline run on one
    # seed only is in the per-seed rows above, not here)
    for (w, rps), runs in by_level.items():
        if len(runs) < 2:
            continue
        common = set.intersection(*(set(base) for _, base in runs))
        parts = []
        for s in STATS:
            gm, lo, hi = seed_interval([min(base[p][s] for p in common) / m[s] for m, base in runs])
            parts.append(f"{s.split('_')[0]} {gm:.2f}x ({lo:.2f}-{hi:.2f})")
        print(f"{w} @ {rps:g}, {len(runs)} seeds, over the fastest of {', '.join(sorted(common))}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
