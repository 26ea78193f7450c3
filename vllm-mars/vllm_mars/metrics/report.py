"""``report.md`` and PNG plots for one run and for a comparison (matplotlib, Agg backend).

matplotlib is imported only when a plot is drawn: it is heavy, and the CLI imports this module.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_mars.metrics.events import read_events
from vllm_mars.metrics.summary import percentile

logger = logging.getLogger(__name__)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def series(events: Sequence[dict]) -> dict[str, Any]:
    """Plot data from one run's events."""
    e2e, arrive = [], {}
    kv_t, kv_u, ret, act, que, rem = [], [], [], [], [], []
    win_t, win = [], []
    ttft: dict[int, list[float]] = defaultdict(list)
    for e in events:
        ev = e.get("event")
        if ev == "workflow_arrive":
            arrive[e["workflow"]] = e["ts"]
        elif ev == "workflow_done" and e.get("root_done") and e["workflow"] in arrive:
            e2e.append(e["ts"] - arrive[e["workflow"]])
        elif ev == "call_end" and e.get("ttft_s") is not None:
            ttft[int(e.get("turn", 0))].append(e["ttft_s"])
        elif ev == "kv_sample":
            kv_t.append(e["ts"])
            kv_u.append(e.get("kv_usage"))
            total = e.get("total_blocks", e.get("num_blocks"))  # num_blocks: runs before the one Telemetry
            ret.append((e["retained_blocks"] / total) if total and e.get("retained_blocks") is not None else None)
            act.append(e.get("active"))
            que.append(e.get("queued"))
            rem.append(e.get("kv_blocks_removed"))
        elif ev == "admission_window":
            w = e.get("new", e.get("window"))
            if isinstance(w, (int, float)):
                win_t.append(e["ts"])
                win.append(w)
        elif ev == "admission_admit" and isinstance(e.get("limit"), (int, float)):
            win_t.append(e["ts"])
            win.append(e["limit"])
    return {"e2e": sorted(e2e), "ttft": dict(sorted(ttft.items())), "kv_t": kv_t, "kv_usage": kv_u,
            "retained": ret, "active": act, "queued": que, "removed": rem, "win_t": win_t, "window": win}


def plot_runs(runs: Mapping[str, Sequence[dict]], out: Path, suffix: str = "") -> list[str]:
    """Four plots over ``runs`` (label -> events). Returns the file names written."""
    plt = _plt()
    data = {label: series(ev) for label, ev in runs.items()}
    files = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, d in data.items():
        xs = d["e2e"]
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    ax.set_xlabel("workflow E2E latency (s)")
    ax.set_ylabel("CDF")
    ax.set_title("E2E latency CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    files.append(_save(fig, out / f"e2e_cdf{suffix}.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, d in data.items():
        turns = list(d["ttft"])
        if turns:
            ax.plot(turns, [percentile(d["ttft"][t], 50) for t in turns], marker="o", label=f"{label} p50")
            ax.plot(turns, [percentile(d["ttft"][t], 90) for t in turns], ls="--", marker=".", label=f"{label} p90")
    ax.set_xlabel("round (turn index)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT by round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    files.append(_save(fig, out / f"ttft_by_round{suffix}.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, d in data.items():
        pts = [(t, u) for t, u in zip(d["kv_t"], d["kv_usage"]) if u is not None]
        if pts:
            line, = ax.plot(*zip(*pts), label=f"{label} KV used")
            rp = [(t, r) for t, r in zip(d["kv_t"], d["retained"]) if r is not None]
            if rp and any(r for _, r in rp):
                ax.plot(*zip(*rp), ls=":", color=line.get_color(), label=f"{label} retained")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("fraction of KV blocks")
    ax.set_ylim(0, 1.05)
    ax.set_title("KV usage over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    files.append(_save(fig, out / f"kv_usage{suffix}.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4))
    any_removed = False
    for label, d in data.items():
        pts = [(t, r) for t, r in zip(d["kv_t"], d["removed"]) if r is not None]
        if pts:
            any_removed = True
            ax.step(*zip(*pts), where="post", label=label)
    if any_removed:
        ax.set_xlabel("time (s)")
        ax.set_ylabel("cached KV blocks evicted (cumulative)")
        ax.set_title("KV block removals over time (vLLM KV cache events)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        files.append(_save(fig, out / f"kv_removals{suffix}.png", plt))
    else:
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, d in data.items():
        pts = [(t, a) for t, a in zip(d["kv_t"], d["active"]) if a is not None]
        if pts:
            line, = ax.plot(*zip(*pts), label=f"{label} active roots")
            if d["window"]:
                ax.step(d["win_t"], d["window"], where="post", ls="--", color=line.get_color(),
                        label=f"{label} admission limit")
            qs = [(t, q) for t, q in zip(d["kv_t"], d["queued"]) if q is not None]
            if qs and any(q for _, q in qs):
                ax.plot(*zip(*qs), ls=":", color=line.get_color(), label=f"{label} queued")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("root workflows")
    ax.set_title("Admission window over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    files.append(_save(fig, out / f"admission{suffix}.png", plt))
    return files


def _save(fig, path: Path, plt) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def summary_table(rows: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """Markdown table of summaries (label, summary)."""
    head = ("| policy | done | mean E2E (s) | p50 | p95 | p99 | goodput@3 (wf/s) | within 3x | preempt | "
            "recomputed tok | prefix hit | mean TTFT (s) | KV mean | retained blk-s | KV blk evicted |")
    lines = [head, "|" + "|".join(["---"] * 15) + "|"]
    for label, s in rows:
        e = s.get("e2e_s") or {}
        lines.append("| " + " | ".join([
            label, f"{s.get('completed')}/{s.get('workflows')}", _fmt(e.get("mean")), _fmt(e.get("p50")),
            _fmt(e.get("p95")), _fmt(e.get("p99")), _fmt((s.get("goodput_wps") or {}).get("3.0"), 3),
            _fmt((s.get("goodput_within") or {}).get("3.0")), _fmt(s.get("preemptions")),
            _fmt(s.get("recomputed_tokens")), _fmt(s.get("prefix_hit_rate")),
            _fmt((s.get("ttft_s") or {}).get("mean"), 3), _fmt((s.get("kv_usage") or {}).get("mean")),
            _fmt(s.get("retained_block_seconds"), 1), _fmt(s.get("kv_blocks_removed"))]) + " |")
    return "\n".join(lines)


def write_run_report(run_dir: str | Path, summary: Mapping[str, Any], plots: bool = True,
                     events: Sequence[dict] | None = None) -> Path:
    """``report.md`` of one run, with its PNG plots unless ``plots`` is False (``events``: the run's
    events when the caller has read them already)."""
    run_dir = Path(run_dir)
    label = str(summary.get("policy") or "run")
    files: list[str] = []
    try:
        files = plot_runs({label: read_events(run_dir) if events is None else events}, run_dir) if plots else []
    except Exception:
        logger.warning("plotting failed", exc_info=True)
    ttft = summary.get("ttft_by_round") or {}
    lines = [f"# Replay report: {label}", "",
             f"- workload: `{summary.get('workload')}`", (f"- backend: {summary.get('backend')}, rps: {summary.get('rps')}, "
             f"admission: {summary.get('controller')}"),
             f"- T_ideal: {summary.get('t_ideal_source') or 'none (goodput not computed)'}",
             f"- makespan: {_fmt(summary.get('makespan_s'))} s, completion rate: {_fmt(summary.get('completion_rate'))}",
             "", summary_table([(label, summary)]), "",
             "Goodput (workflows/s finishing within alpha x T_ideal): " + ", ".join(
                 f"alpha {a}: {_fmt(v, 3)}" for a, v in (summary.get("goodput_wps") or {}).items()), "",
             "TTFT by round (s): " + ", ".join(f"r{t}: p50 {_fmt(d.get('p50'), 3)} / p90 {_fmt(d.get('p90'), 3)}"
                                              for t, d in ttft.items()), ""]
    lines += [f"![{p}]({p})" for p in files]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
