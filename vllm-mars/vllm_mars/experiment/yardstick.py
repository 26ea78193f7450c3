"""The admission yardstick in an experiment's report: per cell, the best static cap on concurrent
roots (swept as variants of ``fcfs-cap`` / ``mars-cap``, :mod:`vllm_mars.admission.cap`) beside mars.

Per cell and kind (the driver policy behind the cap): the cap with the lowest mean E2E among the
runs that completed every workflow (hindsight-best), its mean E2E, and mars's speedup over it
(best cap's mean E2E / mars's: above 1, mars's adaptive admission beats the best cap tuned for that
cell; below 1, the cap wins). ``edge`` marks a best cap at the end of the swept range (the true best
may lie outside it). ``share beyond the cap``: of mars's gain over the fastest baseline, the part a
best cap does not already give, (best cap - mars) / (fastest baseline - mars) of the mean E2E.

Over seeds (the cells of one workload and load level, two or more seeds): the cap with the lowest
mean E2E averaged over the seeds that ran it (one cap for all seeds, chosen in hindsight), mars's
speedup over it per seed (geometric mean and its 95 % interval), and mars's speedup over each seed's
own hindsight-best cap (geometric mean and the lowest).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_mars.experiment.summary import seed_interval
from vllm_mars.metrics.compare import is_yardstick
from vllm_mars.metrics.report import _fmt


def _cap(exp: Any, label: str) -> int | None:
    v = exp.variants.get(label) or {}
    cap = (v.get("admission_options") or {}).get("cap")
    if cap is None and is_yardstick(label):
        from vllm_mars.admission.cap import CapConfig

        cap = CapConfig().cap
    return cap


def yardstick_rows(exp: Any, cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell and kind of capped run (see the module)."""
    kinds: dict[str, list[str]] = {}
    for label in exp.policies:
        driver = (exp.variants.get(label) or {}).get("policy", label)
        if is_yardstick(driver):
            kinds.setdefault(driver, []).append(label)
    rows = []
    for c in cells:
        pols = c["policies"]
        mars = (pols.get("mars") or {}).get("mean_e2e_s")
        base = (pols.get(c.get("baseline")) or {}).get("mean_e2e_s")
        for kind, labels in kinds.items():
            swept = sorted(((_cap(exp, lb), lb) for lb in labels if lb in pols), key=lambda t: t[0] or 0)
            done = [(cap, lb, pols[lb]["mean_e2e_s"]) for cap, lb in swept
                    if pols[lb].get("mean_e2e_s") is not None and pols[lb].get("completed") == pols[lb].get("workflows")]
            if not done:
                continue
            cap, lb, e2e = min(done, key=lambda t: t[2])
            caps = [t[0] for t in swept]
            rows.append({"key": c["key"], "workload": c["workload"], "rps": c["rps"], "seed": c["seed"],
                         "kind": kind, "best_cap": cap, "best_label": lb, "best_mean_e2e_s": e2e,
                         "edge": cap in (caps[0], caps[-1]) and len(caps) > 1, "caps": caps,
                         "sweep": {str(t[0]): t[2] for t in done},
                         "mars_mean_e2e_s": mars, "mars_over_best_cap": e2e / mars if mars else None,
                         "baseline": c.get("baseline"), "baseline_mean_e2e_s": base,
                         "share_beyond_cap": (e2e - mars) / (base - mars) if mars and base and base > mars else None})
    return rows


def yardstick_seed_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload, load level and kind with two or more seeds (see the module)."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r["mars_mean_e2e_s"]:
            groups.setdefault((r["workload"], r["rps"], r["kind"]), []).append(r)
    out = []
    for (workload, rps, kind), rs in groups.items():
        common = set.intersection(*(set(r["sweep"]) for r in rs))
        if len(rs) < 2 or not common:
            continue
        means = {cap: sum(r["sweep"][cap] for r in rs) / len(rs) for cap in common}
        best = min(means, key=lambda cap: means[cap])
        over = [r["sweep"][best] / r["mars_mean_e2e_s"] for r in rs]
        own = [r["mars_over_best_cap"] for r in rs]
        g, lo, hi = seed_interval(over)
        out.append({"workload": workload, "rps": rps, "kind": kind, "seeds": [r["seed"] for r in rs],
                    "caps": sorted(common, key=int), "best_cap": int(best), "best_mean_e2e_s": means[best],
                    "mars_mean_e2e_s": sum(r["mars_mean_e2e_s"] for r in rs) / len(rs),
                    "mars_over_best_cap": g, "low": lo, "high": hi, "per_seed": over,
                    "mars_over_own_best": seed_interval(own)[0], "mars_over_own_best_min": min(own)})
    return out


def format_yardstick(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The table.md section (markdown lines)."""
    lines = ["## Admission yardstick: the best static cap per cell", "",
             ("A static cap on concurrent roots (fcfs-cap: fcfs behind it; mars-cap: mars's scheduler behind it), "
              "swept per cell, its best value chosen in hindsight. mars / best cap = the best cap's mean E2E over "
              "mars's (> 1: mars's untuned adaptive admission is faster than the best cap). Beyond the cap = the "
              "share of mars's gain over the fastest baseline that the best cap does not already give. edge = the "
              "best cap is at the end of the swept range."), "",
             ("| workload | rps | seed | behind the cap | caps swept | best cap | best cap mean E2E (s) | mars mean E2E (s) "
             "| mars speedup over the best cap | fastest baseline (mean E2E s) | share of mars's gain beyond the cap |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = r["mars_over_best_cap"]
        share = r["share_beyond_cap"]
        lines.append("| " + " | ".join([
            r["workload"], f"{r['rps']:g}", str(r["seed"]), r["kind"].removesuffix("-cap"),
            ", ".join(str(x) for x in r["caps"]), f"{r['best_cap']}" + (" (edge)" if r["edge"] else ""),
            _fmt(r["best_mean_e2e_s"]), _fmt(r["mars_mean_e2e_s"]), "-" if sp is None else f"{sp:.2f}x",
            f"{r['baseline'] or '-'} ({_fmt(r['baseline_mean_e2e_s'])})", "-" if share is None else f"{share:.0%}"]) + " |")
    lines += ["", "Mean E2E (s) per swept cap:", ""]
    for r in rows:
        sweep = ", ".join(f"{k}: {_fmt(v)}" for k, v in r["sweep"].items())
        lines.append(f"- {r['key']} {r['kind']}: {sweep}")
    seeds = yardstick_seed_rows(rows)
    if seeds:
        lines += ["", "### Over seeds", "",
                  ("Per workload, load level and kind: the cap whose mean E2E averaged over the seeds is the lowest "
                   "(caps run on every seed), mars's speedup over it (geometric mean over the seeds, 95 % interval, "
                   "per seed), and over each seed's own best cap (geometric mean, lowest)."), "",
                  ("| workload | rps | seeds | behind the cap | caps | best cap | its mean E2E (s) | mars mean E2E (s) "
                   "| mars speedup over it (95 % interval) | per seed | over each seed's best cap (lowest) |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in seeds:
            lines.append("| " + " | ".join([
                r["workload"], f"{r['rps']:g}", ", ".join(str(x) for x in r["seeds"]), r["kind"].removesuffix("-cap"),
                ", ".join(r["caps"]), str(r["best_cap"]), _fmt(r["best_mean_e2e_s"]), _fmt(r["mars_mean_e2e_s"]),
                f"{r['mars_over_best_cap']:.3f}x ({r['low']:.3f}-{r['high']:.3f})",
                ", ".join(f"{x:.3f}" for x in r["per_seed"]),
                f"{r['mars_over_own_best']:.3f}x ({r['mars_over_own_best_min']:.3f})"]) + " |")
    return lines + [""]
