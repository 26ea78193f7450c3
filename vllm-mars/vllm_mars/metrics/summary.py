"""``summary.json`` from the event log alone, so any run directory can be re-summarised.

E2E = root workflow end (the root and all its children done) - root arrival, admission queueing
included. Goodput(alpha) = root workflows finishing within ``alpha * t_ideal`` per second of
makespan (first arrival to last end); ``t_ideal`` rides on each ``workflow_arrive`` event and its
source (cost model or solo run) on ``run_start``.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

ALPHAS = (1.5, 2.0, 3.0, 5.0)
DEFAULT_ALPHA = 3.0
#: the summary key of goodput at the default alpha
GOODPUT = f"goodput_wps_alpha{DEFAULT_ALPHA}"


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist(xs: Sequence[float]) -> dict[str, float | int | None]:
    return {"n": len(xs), "mean": (sum(xs) / len(xs)) if xs else None,
            **{f"p{q}": percentile(xs, q) for q in (50, 90, 95, 99)}}


def _time_weighted(samples: list[tuple[float, float]]) -> tuple[float | None, float]:
    """(time-weighted mean, integral) of a step function given as (ts, value) samples."""
    if not samples:
        return None, 0.0
    integral = 0.0
    for (t0, v0), (t1, _) in itertools.pairwise(samples):
        integral += v0 * (t1 - t0)
    span = samples[-1][0] - samples[0][0]
    return (integral / span if span > 0 else samples[-1][1]), integral


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    arrive: dict[str, dict] = {}
    done: dict[str, float] = {}
    errors: dict[str, str] = {}
    calls: list[dict] = []
    tools: list[dict] = []
    samples: list[dict] = []
    agents: list[dict] = []  # live-agent (mas_task_v1) task ends
    windows: list[tuple[float, float]] = []
    run_start: dict[str, Any] = {}
    run_end: dict[str, Any] = {}
    admits = 0
    waits: list[float] = []  # root admission waits (arrival -> workflow_start)
    for e in events:
        ev = e.get("event")
        if ev == "workflow_arrive":
            arrive[e["workflow"]] = e
        elif ev == "workflow_done" and e.get("root_done"):
            done[e["workflow"]] = e["ts"]
        elif ev == "workflow_error" and e.get("root_done"):
            errors[e["workflow"]] = e.get("error", "")
        elif ev == "call_end":
            calls.append(e)
        elif ev == "tool_end":
            tools.append(e)
        elif ev == "kv_sample":
            samples.append(e)
        elif ev == "admission_window" and isinstance(e.get("new", e.get("window")), (int, float)):
            windows.append((e["ts"], float(e.get("new", e.get("window")))))
        elif ev == "admission_admit":
            admits += 1
        elif ev == "workflow_start" and e.get("admission_wait_s") is not None:
            waits.append(e["admission_wait_s"])
        elif ev == "agent_done":
            agents.append(e)
        elif ev == "run_start":
            run_start = e
        elif ev == "run_end":
            run_end = e

    e2e, ok = {}, {}
    for wid, t_end in done.items():
        a = arrive.get(wid)
        if a is None:
            continue
        e2e[wid] = t_end - a["ts"]
        ok[wid] = a.get("t_ideal_s")
    t_first = min((a["ts"] for a in arrive.values()), default=0.0)
    ends = list(done.values()) + [e["ts"] for e in calls]
    t_last = max(ends, default=t_first)
    makespan = max(t_last - t_first, 1e-9)

    goodput, within = {}, {}
    for alpha in ALPHAS:
        n = sum(1 for w, v in e2e.items() if ok[w] is not None and v <= alpha * ok[w])
        within[str(alpha)] = n
        goodput[str(alpha)] = n / makespan
    slowdown = [e2e[w] / ok[w] for w in e2e if ok[w]]

    by_turn: dict[int, list[float]] = defaultdict(list)
    for c in calls:
        if c.get("ttft_s") is not None:
            by_turn[int(c.get("turn", 0))].append(c["ttft_s"])
    prompt = sum(c.get("prompt_tokens", 0) for c in calls)
    cached = sum(c.get("cached_tokens") or 0 for c in calls)
    output = sum(c.get("output_tokens", 0) for c in calls)

    def counter(key: str) -> int | None:
        vals = [s[key] for s in samples if s.get(key) is not None]
        return int(vals[-1] - vals[0]) if vals else None

    usage = [(s["ts"], s["kv_usage"]) for s in samples if s.get("kv_usage") is not None]
    kv_mean, _ = _time_weighted(usage)
    _, retained_bs = _time_weighted([(s["ts"], s["retained_blocks"]) for s in samples
                                     if s.get("retained_blocks") is not None])
    tool_s = [t.get("duration_s", 0.0) for t in tools]
    tool_wait = [t.get("wait_s", 0.0) for t in tools]
    n = len(arrive)
    return {
        "policy": run_start.get("policy"),
        "controller": run_start.get("controller"),
        "backend": run_start.get("backend"),
        "workload": run_start.get("workload"),
        "rps": run_start.get("rps"),
        "t_ideal_source": run_start.get("t_ideal_source"),
        "workflows": n,
        "completed": len(e2e),
        "errors": len(errors),
        "completion_rate": len(e2e) / n if n else None,
        "makespan_s": makespan,
        "e2e_s": dist(list(e2e.values())),
        "slowdown": dist(slowdown),
        "goodput_wps": goodput,
        "goodput_within": within,
        "goodput_alpha_default": DEFAULT_ALPHA,
        "throughput": {"workflows_per_s": len(e2e) / makespan, "output_tokens_per_s": output / makespan,
                       "prompt_tokens_per_s": prompt / makespan},
        "calls": {"n": len(calls), "latency_s": dist([c["latency_s"] for c in calls if "latency_s" in c]),
                  "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output},
        "ttft_by_round": {str(t): dist(v) for t, v in sorted(by_turn.items())},
        "ttft_s": dist([x for v in by_turn.values() for x in v]),
        "prefix_hit_rate": cached / prompt if prompt else None,
        "preemptions": counter("preemptions"),
        "recomputed_tokens": counter("recomputed_tokens"),
        "kv_blocks_removed": counter("kv_blocks_removed"),
        "retained_block_seconds": retained_bs,
        "kv_usage": {"mean": kv_mean, "max": max((u for _, u in usage), default=None)},
        "tools": {"n": len(tools), "total_s": sum(tool_s), "mean_wait_s": (sum(tool_wait) / len(tool_wait))
                  if tool_wait else None},
        "admission": {"admitted": admits, "window_min": min((w for _, w in windows), default=None),
                      "window_max": max((w for _, w in windows), default=None),
                      "window_updates": len(windows), "wait_s": dist(waits)},
        "engine": run_end.get("engine"),
        # live-agent (mas_task_v1) runs only: rounds the model took and how many outputs did not parse
        "agent": {"tasks": len(agents), "rounds": sum(a.get("rounds", 0) for a in agents),
                  "parse_failures": sum(a.get("parse_failures", 0) for a in agents),
                  "outcomes": {o: sum(1 for a in agents if a.get("outcome") == o)
                               for o in sorted({a.get("outcome") for a in agents})}} if agents else None,
        "wall_s": run_end.get("ts"),
    }
