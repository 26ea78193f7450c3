"""The no-thrash limit of an experiment: how much of the gap between the fastest baseline and the
same workload on an unbounded KV pool mars closes.

The limit is another experiment's ``results.json`` (e.g. ``experiments/studies/paper_grid_nothrash_kernels.toml``:
the thrash cells with fcfs on a pool scaled so that nothing is ever evicted). Per cell present in
both (same ``WORKLOAD/rpsR/seedS`` key and the same workload definition), the limit's mean E2E is
the fastest of its policies that completed every workflow, and

    gap closed = (E2E_fastest_baseline - E2E_mars) / (E2E_fastest_baseline - E2E_limit)

1 = mars reaches the limit, 0 = no better than the fastest baseline, < 0 = worse; None where the
baseline is within ``MIN_GAP`` (1 %) of the limit (no gap: the share would be noise over a few
seconds) or a number is missing. Everything is computed from the
two records alone, so it works on whatever results.json it is given (``mars experiment run`` with
``limit`` in the file or ``--limit``, and ``mars experiment gap RESULTS LIMIT``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_mars.metrics.report import _fmt

#: Workload fields (results.json ``config.workloads``) that must agree for two cells to be the same
#: workload; ``num_workflows`` and ``arrival`` fall back to the experiment's ``config.replay``.
_SAME = ("preset", "path", "weka", "scale", "max_context", "max_tool_s")
#: Engine settings (``config.replay``) that must agree too (the pool itself is what differs).
_SAME_ENGINE = ("backend", "profile", "max_num_seqs", "max_num_batched_tokens", "max_model_len")


def load_limit(path: str | Path) -> dict[str, Any]:
    """A limit results.json, checked for the fields this module reads (one-line ValueError)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p} not found (a results.json written by `mars experiment run`)")
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not JSON: {e}") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("cells"), list) or not isinstance(rec.get("config"), dict):
        raise ValueError(f"{p}: not an experiment results.json (needs 'cells' and 'config')")  # noqa: TRY004 - a bad file: exit 2
    for i, c in enumerate(rec["cells"]):
        if not isinstance(c, dict) or not isinstance(c.get("key"), str) or not isinstance(c.get("policies"), dict):
            raise ValueError(f"{p}: cells[{i}]: needs 'key' and 'policies'")  # noqa: TRY004
    rec.setdefault("experiment", p.parent.name)
    return rec


#: A gap below this share of the limit's mean E2E is no gap (the cell does not thrash).
MIN_GAP = 0.01


def gap_closed(baseline_e2e: float | None, mars_e2e: float | None, limit_e2e: float | None) -> float | None:
    """(baseline - mars) / (baseline - limit); None without a gap (baseline within MIN_GAP of the
    limit, or below it) or without a number."""
    if baseline_e2e is None or mars_e2e is None or limit_e2e is None:
        return None
    if not baseline_e2e - limit_e2e > MIN_GAP * limit_e2e:
        return None
    return (baseline_e2e - mars_e2e) / (baseline_e2e - limit_e2e)


def workload_identity(record: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    cfg = record.get("config") or {}
    replay = cfg.get("replay") or {}
    w = next((w for w in cfg.get("workloads") or [] if w.get("name") == name), None)
    if w is None:
        return None
    ident = {k: w.get(k) for k in _SAME}
    for k in ("path", "weka"):  # machine-local absolute paths: the file name identifies them
        if ident[k]:
            ident[k] = Path(ident[k]).name
    ident["num_workflows"] = w.get("num_workflows") or replay.get("num_workflows")
    ident["arrival"] = w.get("arrival") or replay.get("arrival")
    ident.update({k: replay.get(k) for k in _SAME_ENGINE})
    return ident


def _differs(record: Mapping[str, Any], limit: Mapping[str, Any], name: str) -> str | None:
    a, b = workload_identity(record, name), workload_identity(limit, name)
    if a is None or b is None:
        return "workload not described in config.workloads"
    bad = [f"{k} {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b.get(k)]
    return ", ".join(bad) or None


def _fastest_complete(policies: Mapping[str, Mapping[str, Any]]) -> tuple[str, Mapping[str, Any]] | None:
    done = [(p, d) for p, d in policies.items()
            if d.get("mean_e2e_s") is not None and d.get("completed") == d.get("workflows")]
    return min(done, key=lambda pd: pd[1]["mean_e2e_s"]) if done else None


def limit_rows(record: Mapping[str, Any], limit: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, notes): per cell of ``record`` with a same-workload cell in ``limit``, the limit and the
    share of the gap mars closed; notes name the cells that share a key but not the workload."""
    by_key = {c["key"]: c for c in limit["cells"]}
    rows, notes = [], []
    for c in record["cells"]:
        lc = by_key.get(c.get("key"))
        if lc is None:
            continue
        diff = _differs(record, limit, c["workload"])
        if diff:
            notes.append(f"{c['key']}: not the same workload as the limit's ({diff})")
            continue
        best = _fastest_complete(lc["policies"])
        lp, ld = best if best else (None, {})
        base = (c["policies"].get(c.get("baseline")) or {}).get("mean_e2e_s")
        mars = (c["policies"].get("mars") or {}).get("mean_e2e_s")
        lim = ld.get("mean_e2e_s")
        rows.append({"key": c["key"], "workload": c["workload"], "rps": c["rps"], "seed": c["seed"],
                     "limit_policy": lp, "limit_mean_e2e_s": lim, "limit_preemptions": ld.get("preemptions"),
                     "limit_kv_blocks_removed": ld.get("kv_blocks_removed"),
                     "baseline": c.get("baseline"), "baseline_mean_e2e_s": base, "mars_mean_e2e_s": mars,
                     "gap_closed": gap_closed(base, mars, lim),
                     "mars_over_limit": mars / lim if mars and lim else None,
                     "baseline_over_limit": base / lim if base and lim else None})
        if best is None:
            notes.append(f"{c['key']}: no policy of the limit completed every workflow")
    return rows, notes


def format_limit(rows: Sequence[Mapping[str, Any]], notes: Sequence[str], source: str) -> list[str]:
    """The table.md section (markdown lines)."""
    lines = ["## Gap to the no-thrash limit", "",
             (f"The limit: the same cell (workload, workflows, arrivals, seed, step times) on an effectively "
              f"unbounded KV pool ({source}), its fastest policy. Gap closed = (baseline - mars) / (baseline - "
              "limit) of the mean E2E: 1 = mars reaches the limit, 0 = no better than the fastest baseline, "
              f"< 0 = worse, '-' = no gap (the baseline within {MIN_GAP:.0%} of the limit). ! = the limit run preempted or evicted KV (its pool was not big "
              "enough to be the limit)."), ""]
    head = ["workload", "rps", "seed", "limit mean E2E (s)", "limit policy", "limit preempt / evicted",
            "fastest baseline", "baseline mean E2E (s)", "mars mean E2E (s)", "baseline / limit", "mars / limit",
            "gap closed"]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        thrashed = bool(r["limit_preemptions"]) or bool(r["limit_kv_blocks_removed"])
        ratio = (lambda v: "-" if v is None else f"{v:.2f}x")
        lines.append("| " + " | ".join([
            r["workload"], f"{r['rps']:g}", str(r["seed"]), _fmt(r["limit_mean_e2e_s"]), str(r["limit_policy"] or "-"),
            f"{_fmt(r['limit_preemptions'])} / {_fmt(r['limit_kv_blocks_removed'])}" + (" !" if thrashed else ""),
            str(r["baseline"] or "-"), _fmt(r["baseline_mean_e2e_s"]), _fmt(r["mars_mean_e2e_s"]),
            ratio(r["baseline_over_limit"]), ratio(r["mars_over_limit"]),
            "-" if r["gap_closed"] is None else f"{r['gap_closed']:.2f}"]) + " |")
    if not rows:
        lines.append("(no cell of this experiment is in the limit's results)")
    lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    return lines
