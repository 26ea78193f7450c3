"""The tables of this README from results.json (run from the repo root with PYTHONPATH=vllm-mars):

    python experiments/paper/results/fig10_h200/tables.py [--only GLOB,...]

Per run (per cell and policy): mean / P90 / P95 E2E, preemptions, recomputed tokens, context blocks
rebuilt (figure 3A's count), KV use max / mean, admission wait, makespan. Per cell and seed: mars's
speedup over the fastest baseline per statistic (the fastest of that statistic). Per load level with
two or more seeds: over the fastest of the baselines run in every one of its seeds, the geometric mean
over the seeds and its 95 % interval (Student's t on the log speedups:
vllm_mars.experiment.summary.seed_interval, as `mars experiment summary --groups`).

With ``--before FILE`` (an earlier results.json, e.g. ``git show COMMIT:<this dir>/results.json``), it
prints instead how each run and each speedup moved from that file to this one (before -> after), for
the runs and cells both files have."""

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


def mars_and_baselines(c: dict, variants: dict) -> tuple[dict | None, dict]:
    """A cell's mars run (None: not run) and its baselines' runs by policy."""
    base = {p: d for p, d in c["policies"].items() if is_baseline(p, (variants.get(p) or {}).get("policy"))}
    return c["policies"].get("mars"), base


def speedups(cells: list[dict], variants: dict) -> dict[str, tuple[dict, dict]]:
    """Per cell key: (the fastest baseline per statistic, mars's speedup over it per statistic)."""
    out = {}
    for c in cells:
        m, base = mars_and_baselines(c, variants)
        if m and base:
            best = {s: min(base, key=lambda p: base[p][s]) for s in STATS}
            out[c["key"]] = (best, {s: base[best[s]][s] / m[s] for s in STATS})
    return out


def seed_lines(cells: list[dict], variants: dict) -> dict[str, str]:
    """Per load level with two or more seeds: the over-seeds line (the fastest of the baselines run in
    every seed of the level; a baseline run on one seed only is in the per-seed rows, not here)."""
    by_level: dict[tuple[str, float], list[tuple[dict, dict]]] = defaultdict(list)
    for c in cells:
        m, base = mars_and_baselines(c, variants)
        if m and base:
            by_level[(c["workload"], c["rps"])].append((m, base))
    out = {}
    for (w, rps), runs in by_level.items():
        if len(runs) < 2:
            continue
        common = set.intersection(*(set(base) for _, base in runs))
        parts = []
        for s in STATS:
            gm, lo, hi = seed_interval([min(base[p][s] for p in common) / m[s] for m, base in runs])
            parts.append(f"{s.split('_')[0]} {gm:.2f}x ({lo:.2f}-{hi:.2f})")
        out[f"{w} @ {rps:g}"] = (f"{w} @ {rps:g}, {len(runs)} seeds, over the fastest of {', '.join(sorted(common))}: "
                                 + ", ".join(parts))
    return out


def moves(before: dict, cells: list[dict], variants: dict) -> None:
    """How each run's mean / P90 / P95 E2E and each cell's speedups moved from ``before`` to ``cells``."""
    old = {c["key"]: c for c in before["cells"]}
    print("| cell | seed | policy | mean E2E (s) | P90 | P95 | preemptions | done |")
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        prev = (old.get(c["key"]) or {}).get("policies") or {}
        for p, d in c["policies"].items():
            if p not in prev:
                continue
            b = prev[p]
            stats = " | ".join(f"{b[s]:.1f} -> {d[s]:.1f} ({d[s] / b[s] - 1:+.1%})" for s in STATS)
            print(f"| {c['workload']} @ {c['rps']:g} | {c['seed']} | {p} | {stats} | "
                  f"{b['preemptions']} -> {d['preemptions']} | {b['completed']} -> {d['completed']} |")
    print()
    was, now = speedups(list(old.values()), variants), speedups(cells, variants)
    print("| cell | seed | fastest baseline per statistic (before -> after) | speedup mean | P90 | P95 |")
    print("|---|---|---|---|---|---|")
    for c in cells:
        if c["key"] not in was or c["key"] not in now:
            continue
        (b0, x0), (b1, x1) = was[c["key"]], now[c["key"]]
        names = " / ".join(b0[s] if b0[s] == b1[s] else f"{b0[s]} -> {b1[s]}" for s in STATS)
        print(f"| {c['workload']} @ {c['rps']:g} | {c['seed']} | {names} | "
              + " | ".join(f"{x0[s]:.3f}x -> {x1[s]:.3f}x" for s in STATS) + " |")
    print()
    lines0, lines1 = seed_lines(list(old.values()), variants), seed_lines(cells, variants)
    for level, line in lines1.items():
        print(f"before: {lines0.get(level, '-')}\nafter:  {line}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="*")
    ap.add_argument("--before", default=None, metavar="RESULTS.json",
                    help="an earlier results.json: print how each run and speedup moved from it")
    args = ap.parse_args()
    rec = json.loads((HERE / "results.json").read_text())
    variants = rec["config"]["variants"]
    cells = [c for c in rec["cells"] if any(fnmatch.fnmatchcase(c["key"], g) for g in args.only.split(","))]
    if args.before:
        try:
            before = json.loads(Path(args.before).read_text())
            if not isinstance(before, dict) or not isinstance(before.get("cells"), list):
                raise ValueError("no 'cells' list: not an experiment results.json")  # noqa: TRY004
        except (OSError, ValueError) as e:
            ap.error(f"--before {args.before}: {e}")
        moves(before, cells, variants)
        return
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
    sp = speedups(cells, variants)
    for c in cells:
        if c["key"] not in sp:
            continue
        m, runs = c["policies"]["mars"], c["policies"]
        best, x = sp[c["key"]]
        names = " / ".join(f"{best[s]} {runs[best[s]][s]:.1f}" for s in STATS)
        print(f"| {c['workload']} @ {c['rps']:g} | {c['seed']} | " + " / ".join(f"{m[s]:.1f}" for s in STATS)
              + f" | {names} | " + " / ".join(f"{x[s]:.2f}x" for s in STATS) + " |")
    print()
    for line in seed_lines(cells, variants).values():
        print(line)


if __name__ == "__main__":
    main()
