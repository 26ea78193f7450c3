"""The paper's table and plots of an experiment: ``results.json``, ``table.md``,
``speedup_heatmap.png``, ``mean_e2e_vs_rps.png``, ``goodput_vs_rps.png``.

Per cell: the speedup of mars's mean E2E over the fastest baseline (metrics.compare.cell_speedup),
and per policy mean / p95 E2E, goodput at alpha 3 and the mechanisms behind them (preemptions,
recomputed tokens, prefix-hit rate, mean admission wait).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_mars.driver.config import REPO_ROOT
from vllm_mars.experiment.figures import draw_figures
from vllm_mars.experiment.limit import format_limit, limit_rows, load_limit
from vllm_mars.experiment.spec import Experiment
from vllm_mars.experiment.yardstick import format_yardstick, yardstick_rows
from vllm_mars.metrics.ideal import CostModel
from vllm_mars.metrics.report import _fmt, _plt, _save
from vllm_mars.metrics.summary import DEFAULT_ALPHA, GOODPUT


def experiment_config(exp: Experiment) -> dict[str, Any]:
    """What results.json records of the experiment's settings (paths as :func:`shown_path` gives them)."""
    return {"file": shown_path(exp.path), "policies": list(exp.policies), "variants": exp.variants,
            "seeds": list(exp.seeds),
            "workloads": [{k: shown_path(v) if isinstance(v, str) else v for k, v in asdict(w).items()}
                          for w in exp.workloads],
            "replay": {k: shown_path(v) if isinstance(v, str) else v for k, v in asdict(exp.base).items()
                       if k not in ("workload", "out", "progress")}}


def shown_path(p: str | Path) -> str:
    """An absolute path inside the repository (or else the working directory) made relative to it;
    any other value as given. results.json and table.md are committed: no machine-local paths."""
    q = Path(p)
    if q.is_absolute():
        for root in (REPO_ROOT, Path.cwd()):
            try:
                return q.resolve().relative_to(root.resolve()).as_posix()
            except ValueError:
                continue
    return str(p)


def write_results(exp: Experiment, out: Path, cells: Sequence[Mapping[str, Any]],
                  cost: CostModel | None) -> dict[str, Any]:
    done = {c["key"] for c in cells}
    record = {"experiment": exp.name, "description": exp.description, "alpha": DEFAULT_ALPHA,
              "config": experiment_config(exp), "cost_model": cost.as_dict() if cost else None,
              "cells": [_strip(c) for c in cells], "missing": [c.key for c in exp.cells() if c.key not in done],
              "missing_runs": [f"{c['key']}/{p}" for c in cells for p in _policies_of(exp, c)
                               if p not in c["policies"]],
              "wall_s": round(sum(c.get("wall_s") or 0 for c in cells), 1),
              **_cpu_total(cells)}
    if exp.limit is not None:

        rows, notes = limit_rows(record, load_limit(exp.limit))
        record["limit"] = {"file": _rel(exp.limit, exp.path), "cells": rows, "notes": notes}
    ystick = yardstick_rows(exp, record["cells"])
    if ystick:
        record["yardstick"] = ystick
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    _render(exp, out, record)
    return record


def _render(exp: Experiment, out: Path, record: Mapping[str, Any]) -> None:
    """``table.md`` and the plots of ``record``."""
    plots = plot_results(exp, record, out) + draw_figures(exp, record, out) if record["cells"] else []
    (out / "table.md").write_text(format_results(exp, record, plots) + "\n")


def redraw_results(exp: Experiment, out: Path) -> dict[str, Any]:
    """``table.md`` and the plots drawn again from ``out/results.json`` as it stands (a fresh clone
    has no run dirs to rebuild it from); results.json itself is left as recorded (its settings are
    the run's, not today's defaults). Returns the record."""
    p = out / "results.json"
    try:
        record = json.loads(p.read_text())
    except ValueError as e:
        raise ValueError(f"{p}: invalid JSON: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("cells"), list):
        raise ValueError(f"{p}: not an experiment's results (no 'cells' list)")  # noqa: TRY004 (the CLI's one-line error)
    if record.get("experiment") != exp.name:
        raise ValueError(f"{p}: results of experiment {record.get('experiment')!r}, not of {exp.path} "
                         f"({exp.name!r})")
    _render(exp, out, record)
    return record


def _cpu_total(cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``cpu_s``: the runs' CPU seconds summed (each run's own, ``metrics.compare.USAGE_FILE``),
    ``cpu_runs``: how many runs recorded it (none did before the field existed)."""
    known = [d["cpu_s"] for c in cells for d in c["policies"].values() if d.get("cpu_s") is not None]
    return {"cpu_s": round(sum(known), 1), "cpu_runs": len(known)}


def _rel(p: Path, exp_file: Path) -> str:
    """``p`` relative to the experiment file's directory where it can be (results.json is committed)."""

    try:
        return os.path.relpath(p, Path(exp_file).resolve().parent)
    except ValueError:
        return str(p)


def _policies_of(exp: Experiment, cell: Mapping[str, Any]) -> tuple[str, ...]:
    w = next(w for w in exp.workloads if w.name == cell["workload"])
    return exp.policies_for(w)


def _strip(c: Mapping[str, Any]) -> dict[str, Any]:
    """A cell without machine-local paths (results.json is committed)."""
    c = dict(c)
    c["policies"] = {p: {k: v for k, v in d.items() if k != "run_dir"} for p, d in c["policies"].items()}
    return c


def _done(d: Mapping[str, Any]) -> str:
    return f"{d['completed']}/{d['workflows']}" if d.get("workflows") is not None else "-"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return (["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _per_policy(cells: Sequence[Mapping], policies: Sequence[str], key: str, best=min, digits: int = 2) -> list[str]:
    """Rows: cell; columns: policies; the best value of each row in bold."""
    rows = []
    for c in cells:
        vals = {p: (c["policies"].get(p) or {}).get(key) for p in policies}
        known = [v for v in vals.values() if v is not None]
        top = best(known) if known else None
        rows.append([c["workload"], f"{c['rps']:g}", str(c["seed"])] + [
            ("**" + _fmt(v, digits) + "**") if v is not None and v == top else _fmt(v, digits)
            for v in vals.values()])
    return _table(["workload", "rps", "seed", *policies], rows)


def _speedup_section(cells: Sequence[Mapping], a: float) -> list[str]:
    """The headline table: per cell mars's speedup over the fastest baseline."""
    lines = ["## Mars speedup over the fastest baseline (mean E2E)", "",
              ("The fastest of the baselines (policies other than mars and its variants) run in the cell; "
              "'-' in the per-policy tables below = not run there. Mean and p95 E2E are over the workflows "
              "that completed; * = some policy in the cell did not complete every workflow (a call waited "
              "past call_timeout_s), so its mean leaves out its slowest workflows: compare goodput there."), ""]
    rows = []
    for c in cells:
        m, b = c["policies"].get("mars") or {}, (c["policies"].get(c.get("baseline")) or {})
        short = any(d.get("completed") != d.get("workflows") for d in c["policies"].values())
        rows.append([c["workload"], f"{c['rps']:g}", str(c["seed"]),
                     ("-" if c.get("speedup") is None else f"{c['speedup']:.2f}x") + (" *" if short else ""),
                     str(c.get("baseline") or "-"), _done(m), _done(b),
                     _fmt(m.get("mean_e2e_s")), _fmt(b.get("mean_e2e_s")), _fmt(m.get("p95_e2e_s")),
                     _fmt(b.get("p95_e2e_s")), _fmt(m.get(GOODPUT), 3), _fmt(b.get(GOODPUT), 3)])
    lines += _table(["workload", "rps", "seed", "speedup", "fastest baseline", "mars done", "baseline done",
                     "mars mean E2E (s)",
                     "baseline mean E2E (s)", "mars p95 (s)", "baseline p95 (s)", f"mars goodput@{a}",
                     f"baseline goodput@{a}"], rows) + [""]
    return lines


def _cpu_line(record: Mapping[str, Any]) -> str:
    """The runs' CPU time for the header (a results.json from before it was recorded has none)."""
    runs = sum(len(c["policies"]) for c in record["cells"])
    n = record.get("cpu_runs") or 0
    if not n:
        return "CPU time of the runs: not recorded"
    return (f"CPU time of the runs, summed: {record['cpu_s']:.0f} s"
            + ("" if n == runs else f" (recorded for {n} of {runs} runs)"))


def format_results(exp: Experiment, record: Mapping[str, Any], plots: Sequence[str] = ()) -> str:
    cells = record["cells"]
    pols = list(exp.policies)
    a = record["alpha"]
    cfg = record["config"]["replay"]
    lines = [f"# Experiment `{exp.name}`", "", exp.description.strip(), "",
             (f"- file: `{shown_path(exp.path)}`; cells run: {len(cells)} of {len(cells) + len(record['missing'])}; "
             f"wall time of the cells, summed: {record['wall_s']:.0f} s; {_cpu_line(record)}"),
             f"- backend: {cfg.get('backend')}" + (f", profile: {cfg.get('profile')}" if cfg.get("profile") else "")
             + f", arrival: {cfg.get('arrival')}, policies: {', '.join(pols)}",
             f"- T_ideal: {(record.get('cost_model') or {}).get('source', 'none')}", ""]
    if record["missing"]:
        lines += [f"Missing cells (not run yet): {', '.join(record['missing'])}", ""]
    if record.get("missing_runs"):
        lines += [(f"Runs not done in the cells above ({len(record['missing_runs'])}): "
                  f"{', '.join(record['missing_runs'])}"), ""]
    if any("mars" in c["policies"] for c in cells):
        lines += _speedup_section(cells, a)
    else:
        lines += ["No `mars` run in this experiment: no speedup table (the per-policy tables are below).", ""]
    if len(exp.seeds) > 1 and any(c.get("speedup") is not None for c in cells):
        lines += ["### Over seeds: mean speedup (min - max)", ""]
        groups: dict[tuple[str, float], list[float]] = {}
        for c in cells:
            if c.get("speedup") is not None:
                groups.setdefault((c["workload"], c["rps"]), []).append(c["speedup"])
        lines += _table(["workload", "rps", "seeds", "speedup"], [
            [w, f"{r:g}", str(len(v)), f"{statistics.fmean(v):.2f}x ({min(v):.2f} - {max(v):.2f})"]
            for (w, r), v in groups.items()]) + [""]
    if record.get("limit"):

        lim = record["limit"]
        lines += format_limit(lim["cells"], lim["notes"], f"`{lim['file']}`")
    if record.get("yardstick"):
        lines += format_yardstick(record["yardstick"])
    lines += ["## Mean E2E (s), per policy (best in bold)", ""] + _per_policy(cells, pols, "mean_e2e_s") + [""]
    lines += ["## P90 E2E (s), per policy", ""] + _per_policy(cells, pols, "p90_e2e_s") + [""]
    lines += ["## p95 E2E (s), per policy", ""] + _per_policy(cells, pols, "p95_e2e_s") + [""]
    lines += [f"## Goodput at alpha {a} (workflows/s within {a} x T_ideal), per policy", ""]
    lines += _per_policy(cells, pols, GOODPUT, best=max, digits=3) + [""]
    lines += ["## Mechanisms per run", "",
              ("preempt = preemptions; recomputed = computed tokens a preemption threw away (computed again "
               "later); prefix hit = cached / prompt tokens (a context evicted from the prefix cache while its "
               "workflow ran a tool is recomputed on its next turn and lowers it); KV evicted = cached KV blocks "
               "removed (vLLM KV events); adm. wait = mean / p95 seconds a root waited for admission; tool wait = mean "
               "seconds a tool call queued for a tool core (0 without `cpu_tool`); KV = mean / max KV usage; CPU = "
               "CPU seconds the run took (user + system, of the process that ran it: a worker's own with --jobs; "
               "'-' for a run recorded before this was; '+vllm': the first run of its process to need vLLM, "
               "whose CPU includes importing it)."), ""]
    rows = []
    for c in cells:
        for p in (p for p in pols if p in c["policies"]):
            d = c["policies"][p]
            rows.append([c["workload"], f"{c['rps']:g}", str(c["seed"]), p,
                         f"{d.get('completed')}/{d.get('workflows')}", _fmt(d.get("mean_e2e_s")),
                         _fmt(d.get("preemptions")), _fmt(d.get("recomputed_tokens")), _fmt(d.get("prefix_hit_rate")),
                         _fmt(d.get("kv_blocks_removed")),
                         f"{_fmt(d.get('mean_admission_wait_s'))} / {_fmt(d.get('p95_admission_wait_s'))}",
                         _fmt(d.get("mean_tool_wait_s")),
                         f"{_fmt(d.get('kv_usage_mean'), 3)} / {_fmt(d.get('kv_usage_max'), 3)}",
                         _fmt(d.get("mean_ttft_s"), 3),
                         _fmt(d.get("cpu_s"), 1) + (" +vllm" if d.get("cpu_imported_vllm") else "")])
    lines += _table(["workload", "rps", "seed", "policy", "done", "mean E2E (s)", "preempt", "recomputed",
                     "prefix hit", "KV evicted", "adm. wait (s)", "tool wait (s)", "KV", "mean TTFT (s)",
                     "CPU (s)"], rows) + [""]
    lines += [f"![{f}]({f})" for f in plots]
    return "\n".join(lines)


def _mean_by(cells: Sequence[Mapping], workload: str, policy: str, key: str) -> list[tuple[float, float]]:
    """(rps, value averaged over seeds) of one workload and policy, sorted by rps."""
    by: dict[float, list[float]] = {}
    for c in cells:
        v = (c["policies"].get(policy) or {}).get(key) if c["workload"] == workload else None
        if v is not None:
            by.setdefault(c["rps"], []).append(v)
    return sorted((r, statistics.fmean(v)) for r, v in by.items())


def _heatmap(plt, wls: Sequence, cells: Sequence[Mapping], out: Path) -> str:
    """mars's speedup per workload x load level (log2 colour scale)."""
    ncol = max(len(w.rps) for w in wls)
    grid = [[float("nan")] * ncol for _ in wls]
    notes = [[""] * ncol for _ in wls]
    for i, w in enumerate(wls):
        for j, r in enumerate(sorted(w.rps)):
            sp = [c["speedup"] for c in cells if c["workload"] == w.name and c["rps"] == r
                  and c.get("speedup") is not None]
            if sp:
                grid[i][j] = statistics.fmean(sp)
                notes[i][j] = f"{grid[i][j]:.2f}x\n{r:g} rps"
    fig, ax = plt.subplots(figsize=(max(1.6 * ncol + 2, 7), 0.9 * len(wls) + 1.5))

    finite = [v for row in grid for v in row if not math.isnan(v)] or [1.0]
    span = max(abs(math.log2(min(finite))), abs(math.log2(max(finite))), 0.1)
    im = ax.imshow([[math.log2(v) if not math.isnan(v) else float("nan") for v in row] for row in grid],
                   cmap="RdBu", vmin=-span, vmax=span, aspect="auto")
    for i in range(len(wls)):
        for j in range(ncol):
            v = grid[i][j]
            dark = not math.isnan(v) and abs(math.log2(v)) > span / 2
            ax.text(j, i, notes[i][j], ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_yticks(range(len(wls)), [w.name for w in wls])
    ax.set_xticks(range(ncol), [f"load {j + 1}" for j in range(ncol)])
    ax.set_title("mars mean-E2E speedup over the fastest baseline (blue > 1)", fontsize=10)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("log2 speedup")
    return _save(fig, out / "speedup_heatmap.png", plt)


def plot_results(exp: Experiment, record: Mapping[str, Any], out: Path) -> list[str]:
    """Speedup heat map (workload x load level) and per-workload curves of mean E2E and goodput."""
    plt = _plt()
    cells = record["cells"]
    wls = [w for w in exp.workloads if any(c["workload"] == w.name for c in cells)]
    files: list[str] = []
    if any(c.get("speedup") is not None for c in cells):  # no mars run: no heat map
        files.append(_heatmap(plt, wls, cells, out))
    for key, fname, label, logy in (("mean_e2e_s", "mean_e2e_vs_rps.png", "mean E2E (s)", True),
                                    (GOODPUT, "goodput_vs_rps.png", f"goodput@{record['alpha']} (wf/s)", False)):
        fig, axes = plt.subplots(1, len(wls), figsize=(4.2 * len(wls), 3.8), squeeze=False)
        for ax, w in zip(axes[0], wls):
            for p in exp.policies:
                pts = _mean_by(cells, w.name, p, key)
                if pts:
                    ax.plot(*zip(*pts), marker="o", lw=2.2 if p == "mars" else 1.0, label=p)
            ax.set_title(w.name)
            ax.set_xlabel("arrival rate (roots/s)")
            ax.set_ylabel(label)
            ys = [y for line in ax.get_lines() for y in line.get_ydata() if y and y > 0]
            if logy and ys and max(ys) > 3 * min(ys):  # log only where it spans a wide range
                # lazy: matplotlib is heavy, loaded only to plot
                from matplotlib.ticker import ScalarFormatter

                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(ScalarFormatter())
                ax.yaxis.set_minor_formatter(ScalarFormatter())
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize="x-small", loc="best")
        files.append(_save(fig, out / fname, plt))
    return files
