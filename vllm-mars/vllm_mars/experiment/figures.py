"""The paper's figures of an experiment, as PNG in its results dir (``figures = [...]`` in the TOML).

Each figure reads ``results.json``'s cells only (so ``mars experiment run --report`` redraws them on a
clone without run dirs); what a figure needs beyond the per-policy headline numbers is recorded per
run in the cell record by :func:`run_figure_data` and per cell by :func:`workload_stats` (only for
experiments that ask for figures), from the run dir's ``summary.json``, ``traces.jsonl`` and
``events.jsonl``:

========================  ==========  =================================================================
name                      paper       what
========================  ==========  =================================================================
``e2e``                   7, 9, 10    mean / P90 / P95 E2E against load per workload, every policy; in
                                      red over each load, mars's speedup over the fastest baseline of
                                      that statistic (:func:`seed_speedup`: per seed, over the
                                      baselines that ran it; lines are all seeds' means)
``throughput_goodput``    2           computed-token throughput (prefill not served from the prefix
                                      cache + recomputed + decoded tokens per second) and goodput
                                      against load: the engine stays busy while goodput collapses
``kv_removals``           3A          KV blocks of a workflow's context removed before its next turn,
                                      over the workflow's normalised progress (turn / last turn), at
                                      each workload's highest load
``ttft_rounds``           3B          TTFT per round (LLM call index) at p50 / p90 / p99, highest load
``inputs``                6           input length (prompt tokens per call) and T_ideal per workflow,
                                      as CDFs per workload
``ablations``             13          each mars variant's mean E2E over mars's, per workload and load
                                      (the mean of per-seed ratios, over the seeds both ran)
========================  ==========  =================================================================

``kv_removals`` counts, per LLM call after a workflow's first, the full blocks of the previous call's
prompt + output (less its last token, which never had KV) that the call did not find in the prefix cache (vLLM's cached tokens; the engine
removed them while the workflow ran its tool): the removals that cost a rebuild. Removals of a
finished workflow's blocks (harmless) are not in it; a preempted call's recompute is in
``recomputed_tokens`` instead.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_mars.metrics.compare import is_baseline, is_mars, is_yardstick, record_speedup
from vllm_mars.metrics.report import _plt, _save
from vllm_mars.metrics.summary import GOODPUT

#: figure name -> (file name, the paper's figure)
FIGURES: dict[str, tuple[str, str]] = {
    "e2e": ("e2e_mean_p90_p95_vs_load.png", "7, 9, 10"),
    "throughput_goodput": ("throughput_vs_goodput.png", "2"),
    "kv_removals": ("kv_removals_by_progress.png", "3A"),
    "ttft_rounds": ("ttft_by_round.png", "3B"),
    "inputs": ("inputs_and_ideal_time.png", "6"),
    "ablations": ("ablations.png", "13"),
}
#: bins of normalised progress (kv_removals)
PROGRESS_BINS = 10
#: quantiles recorded of the input-length and T_ideal distributions (0, 5, ..., 100 %)
QUANTILES = tuple(i / 20 for i in range(21))
_STATS = (("mean", "mean E2E (s)"), ("p90", "P90 E2E (s)"), ("p95", "P95 E2E (s)"))


# -- what the figures need, recorded per run and per cell ------------------------------------------
def _traces(run_dir: Path) -> list[dict[str, Any]]:
    p = run_dir / "traces.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _block_size(run_dir: Path, default: int = 16) -> int:
    p = run_dir / "events.jsonl"
    if p.is_file():
        with p.open() as f:
            for i, line in enumerate(f):
                if '"block_size"' in line:
                    bs = json.loads(line).get("block_size")
                    if isinstance(bs, int) and bs > 0:
                        return bs
                if i > 200:
                    break
    return default


def removals_by_progress(traces: Sequence[Mapping[str, Any]], block_size: int,
                         bins: int = PROGRESS_BINS) -> list[int]:
    """Per bin of normalised progress (call index / last call index, calls after the first), the
    context blocks the call did not find cached of those its previous call left (see the module)."""
    out = [0] * bins
    for t in traces:
        rounds = t.get("rounds") or []
        last = len(rounds) - 1
        for k in range(1, len(rounds)):
            prev, cur = rounds[k - 1], rounds[k]
            # the previous call's last sampled token was never fed back: it has no KV to keep
            left = (prev.get("prompt_tokens") or 0) + max(0, (prev.get("output_tokens") or 0) - 1)
            kept = min(cur.get("prompt_tokens") or 0, left)
            lost = (kept // block_size) - ((cur.get("cached_tokens") or 0) // block_size)
            if lost > 0:
                out[(k * bins + last - 1) // last - 1] += lost  # progress k / last in (0, 1]: bins (i/n, (i+1)/n]
    return out


def run_figure_data(run_dir: str | Path) -> dict[str, Any]:
    """What the figures read of one run beyond the headline numbers (JSON-ready)."""
    d = Path(run_dir)
    s = json.loads((d / "summary.json").read_text())
    calls = s.get("calls") or {}
    span = s.get("makespan_s") or 0.0
    computed = ((calls.get("prompt_tokens") or 0) - (calls.get("cached_tokens") or 0)
                + (calls.get("output_tokens") or 0) + (s.get("recomputed_tokens") or 0))
    ttft = {r: [v.get("p50"), v.get("p90"), v.get("p99")] for r, v in (s.get("ttft_by_round") or {}).items()}
    return {"computed_tokens_per_s": computed / span if span > 0 else None,
            "output_tokens_per_s": (s.get("throughput") or {}).get("output_tokens_per_s"),
            "ttft_by_round_p50_p90_p99": ttft,
            "kv_removed_by_progress": removals_by_progress(_traces(d), _block_size(d))}


def _quantiles(xs: Sequence[float]) -> list[float] | None:
    if not xs:
        return None
    xs = sorted(xs)
    return [xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] for q in QUANTILES]


def workload_stats(run_dir: str | Path) -> dict[str, Any]:
    """The cell's workload as one run saw it: quantiles (0..100 % by 5) of the prompt tokens per call,
    of the first call's prompt per root, and of T_ideal per root (the driver's ``workflow_arrive``)."""
    d = Path(run_dir)
    prompts = [r["prompt_tokens"] for t in _traces(d) for r in t.get("rounds") or [] if r.get("prompt_tokens")]
    first, ideal = [], []
    p = d / "events.jsonl"
    if p.is_file():
        with p.open() as f:
            for line in f:
                if '"workflow_arrive"' in line:
                    e = json.loads(line)
                    if e.get("prefill_tokens") is not None:
                        first.append(e["prefill_tokens"])
                    if e.get("t_ideal_s") is not None:
                        ideal.append(e["t_ideal_s"])
    return {"calls": len(prompts), "roots": len(first), "prompt_tokens_q": _quantiles(prompts),
            "first_prompt_tokens_q": _quantiles(first), "t_ideal_s_q": _quantiles(ideal)}


# -- drawing ---------------------------------------------------------------------------------------
def _driver(exp: Any, label: str) -> str:
    return (exp.variants.get(label) or {}).get("policy", label)


def _seed_mean(cells: Sequence[Mapping], workload: str, rps: float, policy: str, get) -> float | None:
    vals = [v for c in cells if c["workload"] == workload and c["rps"] == rps
            for v in [get(c["policies"].get(policy) or {})] if v is not None]
    return statistics.fmean(vals) if vals else None


def seed_speedup(exp: Any, cells: Sequence[Mapping], workload: str, rps: float, get) -> float | None:
    """mars's speedup over the fastest baseline of one statistic (``get`` of a policy's record) at
    one load, the way ``table.md`` averages speedups over seeds: per seed cell
    :func:`~vllm_mars.metrics.compare.record_speedup` over the baselines that ran that seed, then
    the mean over the seeds with a speedup. Seed means of unequal seed sets are never divided (a
    policy that ran seed 0 only is compared on seed 0 only)."""
    cands = [p for p in exp.policies if is_baseline(p, _driver(exp, p))]
    sp = []
    for c in cells:
        if c["workload"] != workload or c["rps"] != rps:
            continue
        rows = {p: c["policies"][p] for p in ["mars", *cands] if p in c["policies"]}
        s = record_speedup(rows, lambda p: _driver(exp, p), get)["speedup"]
        if s is not None:
            sp.append(s)
    return statistics.fmean(sp) if sp else None


def _e2e(stat: str):
    key = f"{stat}_e2e_s"
    return lambda d: d.get(key)


def _fig(d: Mapping, key: str) -> Any:
    return (d.get("figure") or {}).get(key)


def _workloads(exp: Any, cells: Sequence[Mapping]) -> list:
    return [w for w in exp.workloads if any(c["workload"] == w.name for c in cells)]


def _rps_of(cells: Sequence[Mapping], w: str) -> list[float]:
    return sorted({c["rps"] for c in cells if c["workload"] == w})


def _grid(plt, rows: int, cols: int, w: float = 4.2, h: float = 3.4):
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False)
    return fig, axes


def _logx(ax, xs: Sequence[float]) -> None:
    """Log x axis ticked at the load levels themselves."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    ax.set_xticks(list(xs), [f"{r:g}" for r in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _line(ax, xs, ys, label: str) -> None:
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pts:
        ax.plot(*zip(*pts), marker="o", ms=3.5, lw=2.4 if label == "mars" else 1.0, label=label,
                color="black" if label == "mars" else None, zorder=3 if label == "mars" else 2)


def _plotted(exp: Any) -> list[str]:
    """The policies drawn as lines: all but the yardstick's swept caps (their own table in table.md)."""
    return [p for p in exp.policies if not is_yardstick(_driver(exp, p))]


def fig_e2e(plt, exp: Any, cells: Sequence[Mapping], path: Path) -> int:
    wls = _workloads(exp, cells)
    fig, axes = _grid(plt, len(_STATS), len(wls))
    series = 0
    for j, w in enumerate(wls):
        xs = _rps_of(cells, w.name)
        for i, (stat, label) in enumerate(_STATS):
            ax, get = axes[i][j], _e2e(stat)
            for p in _plotted(exp):
                ys = [_seed_mean(cells, w.name, r, p, get) for r in xs]
                _line(ax, xs, ys, p)
                series += i == 0 and j == 0 and any(y is not None for y in ys)
            for r in xs:  # mars's speedup over the fastest baseline of this statistic, in red
                m, sp = _seed_mean(cells, w.name, r, "mars", get), seed_speedup(exp, cells, w.name, r, get)
                if m and sp is not None:
                    ax.annotate(f"{sp:.2f}x", (r, m), textcoords="offset points", xytext=(0, 7),
                                ha="center", fontsize=7, color="red", fontweight="bold")
            _logx(ax, xs)
            ax.set_xlabel("arrival rate (roots/s)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(w.name)
    axes[0][-1].legend(fontsize="xx-small", loc="best")
    fig.suptitle("E2E vs load, seed means (red: mars's speedup over the fastest\n"
                 "baseline, per seed over the baselines that ran it, mean over seeds)", fontsize=9)
    _save(fig, path, plt)
    return series


def fig_throughput_goodput(plt, exp: Any, cells: Sequence[Mapping], path: Path) -> int:

    wls = _workloads(exp, cells)
    fig, axes = _grid(plt, 2, len(wls))
    series = 0
    for j, w in enumerate(wls):
        xs = _rps_of(cells, w.name)
        for p in _plotted(exp):
            ys = [_seed_mean(cells, w.name, r, p, lambda d: _fig(d, "computed_tokens_per_s")) for r in xs]
            _line(axes[0][j], xs, ys, p)
            series += j == 0 and any(y is not None for y in ys)
            _line(axes[1][j], xs, [_seed_mean(cells, w.name, r, p, lambda d: d.get(GOODPUT)) for r in xs], p)
        axes[0][j].set_title(w.name)
        axes[0][j].set_ylabel("computed tokens/s")
        axes[1][j].set_ylabel("goodput@3 (workflows/s)")
        for ax in axes[:, j]:
            _logx(ax, xs)
            ax.set_xlabel("arrival rate (roots/s)")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize="xx-small", loc="best")
    fig.suptitle("Token throughput (top) against goodput (bottom)", fontsize=10)
    _save(fig, path, plt)
    return series


def _top_load(cells: Sequence[Mapping], w: str) -> list[Mapping]:
    xs = _rps_of(cells, w)
    return [c for c in cells if c["workload"] == w and c["rps"] == xs[-1]] if xs else []


def fig_kv_removals(plt, exp: Any, cells: Sequence[Mapping], path: Path) -> int:
    wls = _workloads(exp, cells)
    fig, axes = _grid(plt, 1, len(wls))
    series = 0
    centres = [(i + 0.5) / PROGRESS_BINS for i in range(PROGRESS_BINS)]
    for j, w in enumerate(wls):
        top = _top_load(cells, w.name)
        for p in _plotted(exp):
            runs = [_fig(c["policies"][p], "kv_removed_by_progress") for c in top if p in c["policies"]]
            runs = [r for r in runs if r]
            if runs:
                _line(axes[0][j], centres, [statistics.fmean(b) for b in zip(*runs)], p)
                series += j == 0
        axes[0][j].set_title(f"{w.name} @ {top[0]['rps']:g} roots/s" if top else w.name)
        axes[0][j].set_xlabel("workflow progress (call / last call)")
        axes[0][j].set_ylabel("context KV blocks removed before reuse")
        axes[0][j].grid(alpha=0.3)
    axes[0][-1].legend(fontsize="xx-small", loc="best")
    _save(fig, path, plt)
    return series


def fig_ttft_rounds(plt, exp: Any, cells: Sequence[Mapping], path: Path) -> int:
    wls = _workloads(exp, cells)
    pct = ("p50", "p90", "p99")
    fig, axes = _grid(plt, len(wls), len(pct))
    series = 0
    for i, w in enumerate(wls):
        top = _top_load(cells, w.name)
        for p in _plotted(exp):
            by_round: dict[int, list[list[float]]] = {}
            for c in top:
                for r, v in (_fig(c["policies"].get(p) or {}, "ttft_by_round_p50_p90_p99") or {}).items():
                    by_round.setdefault(int(r), []).append(v)
            if not by_round:
                continue
            xs = sorted(by_round)
            for k in range(len(pct)):
                ys = [statistics.fmean(v[k] for v in by_round[x] if v[k] is not None)
                      if any(v[k] is not None for v in by_round[x]) else None for x in xs]
                _line(axes[i][k], xs, ys, p)
            series += i == 0
        for k, name in enumerate(pct):
            ax = axes[i][k]
            ax.set_title(f"{w.name} @ {top[0]['rps']:g} roots/s: {name} TTFT" if top else name, fontsize=9)
            ax.set_xlabel("round (LLM call of the workflow)")
            ax.set_ylabel("TTFT (s)")
            ax.set_yscale("symlog", linthresh=0.1)
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize="xx-small", loc="best")
    _save(fig, path, plt)
    return series


def fig_inputs(plt, exp: Any, cells: Sequence[Mapping], path: Path) -> int:
    wls = _workloads(exp, cells)
    panels = (("prompt_tokens_q", "input length per call (tokens)"),
              ("first_prompt_tokens_q", "first call's input per root (tokens)"), ("t_ideal_s_q", "T_ideal per root (s)"))
    fig, axes = _grid(plt, 1, len(panels))
    series = 0
    for w in wls:
        stats = next((c.get("workload_stats") for c in cells if c["workload"] == w.name and c.get("workload_stats")),
                     None)
        if not stats:
            continue
        series += 1
        for k, (key, label) in enumerate(panels):
            if stats.get(key):
                axes[0][k].plot(stats[key], QUANTILES, drawstyle="steps-post", label=w.name)
                axes[0][k].set_xlabel(label)
    for ax in axes[0]:
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize="x-small", loc="best")
    fig.suptitle("Input lengths and ideal time per workload", fontsize=10)
    _save(fig, path, plt)
    return series


def fig_ablations(plt, exp: Any, cells: Sequence[Mapping], path: Path) -> int:
    abl = [p for p in exp.policies if p != "mars" and is_mars(p) and not is_yardstick(_driver(exp, p))]
    wls = _workloads(exp, cells)
    fig, axes = _grid(plt, 1, len(wls), w=max(4.2, 1.2 * max(len(_rps_of(cells, w.name)) for w in wls)))
    width = 0.8 / max(1, len(abl))
    for j, w in enumerate(wls):
        xs = _rps_of(cells, w.name)
        ax = axes[0][j]
        for a, p in enumerate(abl):
            ratios = []
            for r in xs:
                # per seed that both ran, then the mean over those seeds (as seed_speedup)
                per = [v / m for c in cells if c["workload"] == w.name and c["rps"] == r
                       for m, v in [((c["policies"].get("mars") or {}).get("mean_e2e_s"),
                                     (c["policies"].get(p) or {}).get("mean_e2e_s"))] if m and v]
                ratios.append(statistics.fmean(per) if per else 0.0)
            ax.bar([i + a * width - 0.4 + width / 2 for i in range(len(xs))], ratios, width, label=p)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(xs)), [f"{r:g}" for r in xs])
        ax.set_xlabel("arrival rate (roots/s)")
        ax.set_ylabel("mean E2E / mars's (> 1: the ablation is slower)")
        ax.set_title(w.name)
        ax.grid(alpha=0.3, axis="y")
    axes[0][-1].legend(fontsize="xx-small", loc="best")
    _save(fig, path, plt)
    return len(abl)


_DRAW = {"e2e": fig_e2e, "throughput_goodput": fig_throughput_goodput, "kv_removals": fig_kv_removals,
         "ttft_rounds": fig_ttft_rounds, "inputs": fig_inputs, "ablations": fig_ablations}


def draw_figures(exp: Any, record: Mapping[str, Any], out: Path) -> list[str]:
    """The PNG files of ``exp.figures`` drawn from ``record``'s cells into ``out`` (file names)."""
    cells = record["cells"]
    if not cells:
        return []
    names = list(exp.figures)
    if "ablations" in names and not any(p != "mars" and is_mars(p) and not is_yardstick(_driver(exp, p))
                                        for p in exp.policies):
        names.remove("ablations")  # no mars variant to ablate
    plt = _plt()
    files = []
    for name in names:
        fname = FIGURES[name][0]
        _DRAW[name](plt, exp, cells, out / fname)
        files.append(fname)
    return files


