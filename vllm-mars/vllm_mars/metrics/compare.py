"""The comparison table of ``mars compare`` (the paper's shape) from per-run summaries."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from vllm_mars.metrics.events import read_events
from vllm_mars.metrics.report import _fmt, plot_runs, summary_table
from vllm_mars.metrics.summary import DEFAULT_ALPHA

#: A run dir's resource use, beside its summary.json (written by ``driver.compare.run_policies``):
#: ``cpu_s`` (CPU seconds, user + system, of the process that ran it plus of the child processes it
#: waited for, over the run alone), ``children_cpu_s`` (that second part), ``wall_s``,
#: ``imported_vllm`` (the run was its process's first to load vLLM: its CPU includes that import).
#: Kept out of summary.json, which is the run's events alone (byte-identical across re-runs of the sim).
USAGE_FILE = "usage.json"


def run_usage(run_dir: str | Path | None) -> dict[str, Any]:
    """The run dir's :data:`USAGE_FILE` (empty for a run recorded before it existed, or unreadable)."""
    if run_dir is None:
        return {}
    try:
        data = json.loads((Path(run_dir) / USAGE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_mars(policy: str) -> bool:
    return policy == "mars" or policy.startswith("mars-")


def is_yardstick(policy: str) -> bool:
    """``policy`` runs behind the static cap (the admission yardstick, ``admission/cap.py``): its
    registered names are ``<scheduler>-cap`` (driver/control.py). Reported beside mars, never the
    "fastest baseline" of a cell."""
    return policy.endswith("-cap")


def is_baseline(label: str, policy: str | None = None) -> bool:
    """A run is a baseline when neither its label nor its driver policy (a labelled variant's
    ``policy``) is mars, and it is not the admission yardstick (a hindsight-tuned static cap,
    reported beside mars in its own section)."""
    return not is_mars(label) and not is_mars(policy or label) and not is_yardstick(policy or label)


def cell_speedup(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Speedup of mars's mean E2E over the fastest baseline in one cell (:func:`is_baseline`, the
    driver policy from ``summary["policy"]``)."""
    mars = summaries.get("mars")
    base = {p: s for p, s in summaries.items()
            if is_baseline(p, s.get("policy")) and (s.get("e2e_s") or {}).get("mean")}
    if not mars or not (mars.get("e2e_s") or {}).get("mean") or not base:
        return {"speedup": None, "baseline": None}
    best = min(base, key=lambda p: base[p]["e2e_s"]["mean"])
    return {"speedup": base[best]["e2e_s"]["mean"] / mars["e2e_s"]["mean"], "baseline": best,
            "baseline_mean_e2e_s": base[best]["e2e_s"]["mean"], "mars_mean_e2e_s": mars["e2e_s"]["mean"]}


def record_speedup(policies: Mapping[str, Mapping[str, Any]], driver: Callable[[str], str | None],
                   get: Callable[[Mapping[str, Any]], float | None] = lambda d: d.get("mean_e2e_s")) -> dict[str, Any]:
    """:func:`cell_speedup` over a results record's per-policy rows (:func:`compare_record`'s
    ``policies``): ``get`` reads the statistic (mean E2E by default), ``driver(label)`` the policy
    behind a label (a variant's driver)."""
    return cell_speedup({p: {"policy": driver(p), "e2e_s": {"mean": v}}
                         for p, d in policies.items() for v in [get(d)] if v is not None})


def compare_record(workload: str, cells: Mapping[float, Mapping[str, Mapping[str, Any]]],
                   run_dirs: Mapping[float, Mapping[str, str]] | None = None) -> dict[str, Any]:
    """JSON-ready result: per rps, per policy the headline numbers, plus the speedup."""
    a = str(DEFAULT_ALPHA)
    out: dict[str, Any] = {"workload": workload, "alpha": DEFAULT_ALPHA, "cells": []}
    for rps, by_policy in cells.items():
        cell = {"rps": rps, **cell_speedup(by_policy), "policies": {}}
        for p, s in by_policy.items():
            e = s.get("e2e_s") or {}
            run_dir = (run_dirs or {}).get(rps, {}).get(p)
            use = run_usage(run_dir)
            cell["policies"][p] = {
                "mean_e2e_s": e.get("mean"), "p90_e2e_s": e.get("p90"), "p95_e2e_s": e.get("p95"), "p99_e2e_s": e.get("p99"),
                f"goodput_wps_alpha{a}": (s.get("goodput_wps") or {}).get(a),
                f"within_alpha{a}": (s.get("goodput_within") or {}).get(a),
                "completed": s.get("completed"), "workflows": s.get("workflows"),
                "preemptions": s.get("preemptions"), "recomputed_tokens": s.get("recomputed_tokens"),
                "kv_blocks_removed": s.get("kv_blocks_removed"),
                "prefix_hit_rate": s.get("prefix_hit_rate"), "mean_ttft_s": (s.get("ttft_s") or {}).get("mean"),
                "mean_admission_wait_s": ((s.get("admission") or {}).get("wait_s") or {}).get("mean"),
                "p95_admission_wait_s": ((s.get("admission") or {}).get("wait_s") or {}).get("p95"),
                # the tool plane (a tool-bound cell: `[replay] cpu_tool`) and the KV pool it may fill
                "mean_tool_wait_s": (s.get("tools") or {}).get("mean_wait_s"),
                "kv_usage_mean": (s.get("kv_usage") or {}).get("mean"),
                "kv_usage_max": (s.get("kv_usage") or {}).get("max"),
                "makespan_s": s.get("makespan_s"), "t_ideal_source": s.get("t_ideal_source"),
                "cpu_s": use.get("cpu_s"), "cpu_imported_vllm": use.get("imported_vllm"),
                "run_dir": run_dir}
        out["cells"].append(cell)
    return out


def format_table(record: Mapping[str, Any]) -> str:
    """The paper's table shape: one row per (workload, rps) with mars's speedup over the fastest
    baseline, goodput per policy; then a detail table per cell."""
    a = str(record.get("alpha", DEFAULT_ALPHA))
    policies: list[str] = []
    for c in record["cells"]:
        for p in c["policies"]:
            if p not in policies:
                policies.append(p)
    wl = Path(str(record["workload"])).stem
    head = ["workload", "rps", "mars speedup (mean E2E)"] + [f"goodput@{a} {p}" for p in policies]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for c in record["cells"]:
        sp = "-" if c.get("speedup") is None else f"{c['speedup']:.2f}x vs {c['baseline']}"
        row = [wl, _fmt(c["rps"]), sp] + [_fmt(c["policies"].get(p, {}).get(f"goodput_wps_alpha{a}"), 3)
                                         for p in policies]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    dhead = ["rps", "policy", "done", "mean E2E (s)", "p95 E2E (s)", f"goodput@{a} (wf/s)", "preemptions",
             "recomputed tokens", "prefix hit", "KV blocks evicted"]
    lines += ["| " + " | ".join(dhead) + " |", "|" + "|".join(["---"] * len(dhead)) + "|"]
    for c in record["cells"]:
        for p, d in c["policies"].items():
            lines.append("| " + " | ".join([
                _fmt(c["rps"]), p, f"{d.get('completed')}/{d.get('workflows')}", _fmt(d.get("mean_e2e_s")),
                _fmt(d.get("p95_e2e_s")), _fmt(d.get(f"goodput_wps_alpha{a}"), 3), _fmt(d.get("preemptions")),
                _fmt(d.get("recomputed_tokens")), _fmt(d.get("prefix_hit_rate")),
                _fmt(d.get("kv_blocks_removed"))]) + " |")
    return "\n".join(lines)


def write_compare_report(out: str | Path, record: Mapping[str, Any],
                         summaries: Mapping[float, Mapping[str, Mapping[str, Any]]] | None = None) -> Path:
    """``compare.json`` + ``report.md`` with plots per rps (every policy on one figure)."""
    out = Path(out)
    (out / "compare.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# Policy comparison: `{record['workload']}`", "", format_table(record), ""]
    for c in record["cells"]:
        runs = {p: read_events(d["run_dir"]) for p, d in c["policies"].items() if d.get("run_dir")}
        if not runs:
            continue
        suffix = f"_rps{c['rps']:g}"
        files = plot_runs(runs, out, suffix)
        lines += [f"## rps {c['rps']:g}", ""]
        if summaries and c["rps"] in summaries:
            lines += [summary_table(list(summaries[c["rps"]].items())), ""]
        lines += [f"![{f}]({f})" for f in files] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
