"""Mars and its variants over many cells: the ratios the READMEs and RESULTS.md quote.

Per mars policy (``mars`` and every ``mars-*`` label) over the cells of one or more
``results.json`` files (``mars experiment summary``):

* its speedup over the fastest baseline of each cell (that baseline's mean E2E over its own): the
  geometric mean, the lowest (and where), how many cells are below ``1 - tolerance``;
* how many cells its goodput is more than ``tolerance`` below the best baseline's;
* its speedup over a reference policy (``mars`` by default): geometric mean, range, identical cells;
* over seeds: the cells of one workload and load level that differ only in their seed form a group
  (the same setup, as :func:`merge_records` defines it, wherever the cells come from); per group of two
  or more seeds, the geometric mean of the speedup over the fastest baseline and its 95 % confidence
  interval over the seeds (Student's t on the log speedups). A group is *behind beyond seed noise* when
  the whole interval is below 1.0; the row counts those and names the group with the lowest mean. This is
  the issue's "no worse than the fastest baseline within seed noise": a cell's 0.97x whose seeds span
  0.95-1.03x is noise, a group whose every seed is behind is not. The same for goodput at alpha: the
  mean over the seeds of mars's goodput minus the best baseline's, with its 95 % interval (goodput is
  zero in some cells, so the difference, not the ratio); *behind* when the whole interval is below 0.

A baseline is what the experiment's table counts as one (:func:`vllm_mars.metrics.compare.is_baseline`,
a labelled variant's driver policy read from the file's ``config.variants``), or only those named
with ``baselines``. Reads only the files (no run dirs), so it works on committed results.

Each cell stays inside its file (``EXPERIMENT:KEY``) unless the records first go through
:func:`merge_records` (``--merge``), which joins the cells of different files that are the same run
setup into one, so that a variant recorded in one file is compared with the baselines of the same
cell recorded in another.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_mars.experiment.limit import workload_identity
from vllm_mars.metrics.compare import is_baseline

#: ReplayConfig fields (results.json ``config.replay``) that change a run's numbers and must agree for
#: :func:`merge_records` to join two files' cells, besides the workload identity of
#: :mod:`vllm_mars.experiment.limit` (preset, path / weka file name, scale, max_context, max_tool_s, the
#: effective num_workflows and arrival, backend, profile, max_model_len, max_num_seqs,
#: max_num_batched_tokens). Not compared: what only the machine or the output depend on (url,
#: cpu_tool, cpu_gpu, sandbox, tool_net_allow, sample_interval_s, record_steps, plots, calibrate) and
#: what the grid sets per cell or per label (rps and seed are in the key; policy, policy_options,
#: admission_options belong to the label).
MERGE_REPLAY = ("model", "num_blocks", "kv_scale", "block_size", "engine_args", "tools", "tool_timeout_s",
                "call_timeout_s")


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


#: Student's t 0.975 quantiles by degrees of freedom (a df between two entries takes the lower one's,
#: the wider interval); beyond the last, the normal's 1.96.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def _t975(df: int) -> float:
    if df > max(_T975):
        return 1.96
    return _T975[max(d for d in _T975 if d <= df)]


def seed_interval(speedups: Sequence[float]) -> tuple[float, float, float]:
    """(geometric mean, low, high): the 95 % confidence interval of the mean log speedup over seeds
    (two or more), taken back to ratios."""
    m, lo, hi = mean_interval([math.log(x) for x in speedups])
    return math.exp(m), math.exp(lo), math.exp(hi)


def mean_interval(xs: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % confidence interval of the mean of two or more values (Student's t)."""
    n = len(xs)
    if n < 2:
        raise ValueError("an interval over seeds needs two or more of them")
    m = sum(xs) / n
    h = _t975(n - 1) * math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)
    return m, m - h, m + h


def _group_key(rec: Mapping[str, Any], cell: Mapping[str, Any]) -> tuple[str, str]:
    """(label, key) of a cell's seed group: its workload and load level, and (when its file describes
    the workload) the setup that must agree for cells of two seeds to be seeds of one experiment."""
    label = f"{cell.get('workload')}/rps{cell.get('rps'):g}"
    setup = cell["setup"] if "setup" in cell else _setup(rec, cell)  # a merged cell carries its own
    if setup is None:
        return label, f"{label}|{rec.get('experiment', '?')}"
    # the roots a seed's workload has differ by seed: every other field of the setup must agree
    ident = json.dumps({k: v for k, v in setup.items() if k != "roots"}, sort_keys=True, default=str)
    return label, f"{label}|{ident}"


def policy_summary(records: Sequence[Mapping[str, Any]], ref: str = "mars",
                   baselines: Sequence[str] | None = None, only: Sequence[str] | None = None,
                   alpha: float = 3.0, tolerance: float = 0.01) -> list[dict[str, Any]]:
    """One row per mars policy (every label that is not a baseline) present in the selected cells,
    in first-seen order. ``only``: globs over a cell's KEY and EXPERIMENT:KEY (a cell of
    :func:`merge_records`: also each of its files' EXPERIMENT:KEY)."""
    gkey = f"goodput_wps_alpha{float(alpha)}"  # as results.json writes it (goodput_wps_alpha3.0)
    cells = []  # (EXPERIMENT:KEY, the cell's policies, label -> is a baseline)
    for rec in records:
        name = rec.get("experiment", "?")
        variants = (rec.get("config") or {}).get("variants") or {}
        for c in rec["cells"]:
            key = f"{name}:{c['key']}"
            if not _selected(name, c, only):
                continue
            is_base = {p: is_baseline(p, (variants.get(p) or {}).get("policy")) for p in c["policies"]}
            label, gkey_ = _group_key(rec, c)
            cells.append((key, c["policies"], is_base, (label, gkey_, c.get("seed"))))
    order: list[str] = []
    for _, pol, is_base, _ in cells:
        order += [p for p in pol if not is_base[p] and p not in order]
    rows = []
    for p in order:
        vs_base, vs_ref, low_goodput, identical = [], [], 0, 0
        # group key -> (label, seed -> (speedup, goodput minus the best baseline's))
        groups: dict[str, tuple[str, dict[Any, tuple[float, float]]]] = {}
        for key, pol, is_base, (label, group, seed) in cells:
            mine = (pol.get(p) or {}).get("mean_e2e_s")
            if not mine:
                continue
            base = {b: v for b, v in pol.items() if is_base[b] and (baselines is None or b in baselines)
                    and v.get("mean_e2e_s")}
            if base:
                fastest = min(v["mean_e2e_s"] for v in base.values())
                vs_base.append((fastest / mine, key))
                best_g = max((v.get(gkey) or 0.0) for v in base.values())
                mine_g = pol[p].get(gkey) or 0.0
                if mine_g < (1 - tolerance) * best_g:
                    low_goodput += 1
                # a seed counts once (the first file's cell of it)
                groups.setdefault(group, (label, {}))[1].setdefault(seed, (fastest / mine, mine_g - best_g))
            r = (pol.get(ref) or {}).get("mean_e2e_s")
            if r and p != ref:
                vs_ref.append(r / mine)
                identical += abs(r - mine) <= 1e-9 * r
        if not vs_base and not vs_ref:
            continue
        row: dict[str, Any] = {"policy": p, "cells": len(vs_base)}
        if vs_base:
            lowest = min(vs_base)
            row.update(geomean=_geomean([x for x, _ in vs_base]), lowest=lowest[0], lowest_cell=lowest[1],
                       below=sum(x < 1 - tolerance for x, _ in vs_base), goodput_below=low_goodput)
            over = []
            for label, by_seed in groups.values():
                if len(by_seed) >= 2:
                    gm, lo, hi = seed_interval([x for x, _ in by_seed.values()])
                    dg, dlo, dhi = mean_interval([d for _, d in by_seed.values()])
                    over.append({"group": label, "seeds": len(by_seed), "geomean": gm, "low": lo, "high": hi,
                                 "goodput_diff": dg, "goodput_low": dlo, "goodput_high": dhi})
            if over:
                row.update(seed_groups=len(over), seed_behind=sum(g["high"] < 1.0 for g in over),
                           seed_goodput_behind=sum(g["goodput_high"] < 0.0 for g in over),
                           seed_worst=min(over, key=lambda g: g["geomean"]), seed_detail=over)
        if vs_ref:
            row.update(ref=ref, ref_cells=len(vs_ref), ref_geomean=_geomean(vs_ref), ref_min=min(vs_ref),
                       ref_max=max(vs_ref), identical=identical)
            if len(vs_ref) >= 2:  # paired over the cells: the 95 % interval of the mean log ratio
                _, row["ref_low"], row["ref_high"] = seed_interval(vs_ref)
        rows.append(row)
    return rows


def profile_notes(records: Sequence[Mapping[str, Any]], only: Sequence[str] | None = None) -> list[str]:
    """One note when the selected cells of ``records`` (the files as given, before any merge) come from
    more than one backend profile: the over-the-cells columns of :func:`policy_summary` then pool
    different step-time models (the seed groups keep them apart: the profile is part of a group's setup)."""
    files: dict[str, list[str]] = {}
    for rec in records:
        name = rec.get("experiment", "?")
        if any(_selected(name, c, only) for c in rec.get("cells") or ()):
            replay = (rec.get("config") or {}).get("replay") or {}
            prof = f"{replay.get('backend')}:{replay.get('profile')}"
            files.setdefault(prof, []).append(name)
    if len(files) < 2:
        return []
    each = "; ".join(f"{p} ({', '.join(n)})" for p, n in files.items())
    return [(f"the selected cells come from {len(files)} profiles, {each}: the columns over the cells pool "
            "them; the seed groups do not (a group is one profile)")]


def _selected(name: str, cell: Mapping[str, Any], only: Sequence[str] | None) -> bool:
    """Whether a glob of ``only`` matches the cell's KEY or EXPERIMENT:KEY (a merged cell's: or one of
    its files' EXPERIMENT:KEY)."""
    key = cell["key"]
    names = (key, f"{name}:{key}", *(f"{src}:{key}" for src in cell.get("merged_from", ())))
    return not only or any(fnmatch.fnmatchcase(n, g) for n in names for g in only)


def _setup(record: Mapping[str, Any], cell: Mapping[str, Any]) -> dict[str, Any] | None:
    """What must agree for two cells of the same key to be one run setup (None: the cell's workload
    is not described in the file's ``config.workloads``)."""
    ident = workload_identity(record, cell.get("workload"))
    if ident is None:
        return None
    replay = (record.get("config") or {}).get("replay") or {}
    ident.update({k: replay.get(k) for k in MERGE_REPLAY})
    ident["roots"] = cell.get("roots")
    return ident


def _setup_differs(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> str | None:
    if a is None or b is None:
        return "workload not described in config.workloads"
    return ", ".join(f"{k} differs ({a[k]!r} vs {b.get(k)!r})" for k in a if a[k] != b.get(k)) or None


def _same_number(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def merge_records(records: Sequence[Mapping[str, Any]],
                  only: Sequence[str] | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """(records, notes): the cells of ``records`` with the cells of different files that are the same
    run setup joined into one, for :func:`policy_summary`.

    The same setup: the same ``KEY`` (workload, rps, seed), the same ``roots`` in the cell, the same
    workload definition of that name and the same replay settings (:data:`MERGE_REPLAY` and the
    workload identity listed there). Cells with the same key and another setup stay apart, each under
    its own ``EXPERIMENT:KEY``, and a note says what differs. A merged cell holds every label of its
    files; a label in more than one file takes the numbers (and the driver policy of its
    ``config.variants`` entry, which decides whether it is a baseline) of the first file given that has
    it, and a note names the cell, the label and both files where the other's mean E2E differs (by
    more than 1e-9 relative). Each returned record holds one cell, named ``EXP1+EXP2:KEY`` after the
    files that gave it labels (``EXP:KEY`` when one file did, as without merging), in first-seen
    order; the cell's ``merged_from`` lists those experiments, so that ``only`` matches each
    ``EXP:KEY`` too, and its ``setup`` is the run setup it was merged on (the seed groups of
    :func:`policy_summary` are read from it). ``only`` (the globs given to :func:`policy_summary`) keeps the notes to the
    selected cells; every cell is returned."""
    groups: list[dict[str, Any]] = []
    by_key: dict[str, list[dict[str, Any]]] = {}
    notes: list[tuple[list[dict[str, Any]], str]] = []  # (the cells it is about, the note)
    for i, rec in enumerate(records):
        name = rec.get("experiment", "?")
        variants = (rec.get("config") or {}).get("variants") or {}
        for c in rec["cells"]:
            setup = _setup(rec, c)
            group, why = None, None
            for g in by_key.get(c["key"], []):
                if i in g["files"]:  # one file's cells are never joined with each other
                    continue
                diff = _setup_differs(g["setup"], setup)
                if diff is None:
                    group = g
                    break
                why = why or (g, f"{c['key']} in {g['first']} and {name} not merged: {diff}")
            if group is None:
                group = {"setup": setup, "first": name, "files": set(), "sources": [], "variants": {}, "origin": {},
                         "cell": {"key": c["key"], "workload": c.get("workload"), "seed": c.get("seed"),
                                  "rps": c.get("rps"), "roots": c.get("roots"), "policies": {}}}
                groups.append(group)
                by_key.setdefault(c["key"], []).append(group)
                if why:
                    notes.append(([why[0], group], why[1]))
            group["files"].add(i)
            pols = group["cell"]["policies"]
            for p, d in c["policies"].items():
                if p not in pols:
                    pols[p], group["origin"][p] = d, name
                    if p in variants:
                        group["variants"][p] = variants[p]
                    if name not in group["sources"]:
                        group["sources"].append(name)
                    continue
                mine, theirs = (pols[p] or {}).get("mean_e2e_s"), (d or {}).get("mean_e2e_s")
                if not _same_number(mine, theirs):
                    first = group["origin"][p]
                    note = f"{c['key']}: {p} has mean E2E {mine} s in {first} and {theirs} s in {name}: {first}'s taken"
                    notes.append(([group], note))
    for g in groups:
        g["cell"]["merged_from"] = g["sources"] or [g["first"]]
        g["cell"]["setup"] = g["setup"]
        g["name"] = "+".join(g["cell"]["merged_from"])
    out = [{"experiment": g["name"], "config": {"variants": g["variants"]}, "cells": [g["cell"]]} for g in groups]
    return out, [n for about, n in notes if any(_selected(g["name"], g["cell"], only) for g in about)]


def format_policy_summary(rows: Sequence[Mapping[str, Any]], tolerance: float = 0.01) -> list[str]:
    below = f"{1 - tolerance:g}x"
    out = [(f"| policy | cells | vs the fastest baseline: geometric mean | lowest (cell) | cells below {below} "
           f"| goodput more than {tolerance:.0%} below the best baseline's | vs reference: geometric mean [95 % CI over the cells] (min - max) "
           "| identical to the reference | over seeds: groups behind beyond noise | over seeds: lowest group, "
           "geometric mean [95 % CI] | over seeds: groups with goodput behind beyond noise |"),
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "geomean" in r:
            b = [f"{r['geomean']:.4f}x", f"{r['lowest']:.4f}x ({r['lowest_cell']})", str(r["below"]),
                 str(r["goodput_below"])]
        else:
            b = ["-"] * 4
        if "ref" in r:
            ci = f" [{r['ref_low']:.4f} - {r['ref_high']:.4f}]" if "ref_low" in r else ""
            f = [f"{r['ref_geomean']:.4f}x{ci} ({r['ref_min']:.4f} - {r['ref_max']:.4f}) vs {r['ref']}",
                 f"{r['identical']} of {r['ref_cells']}"]
        else:
            f = ["-", "-"]
        if "seed_groups" in r:
            w = r["seed_worst"]
            g = [f"{r['seed_behind']} of {r['seed_groups']}",
                 f"{w['group']} ({w['seeds']} seeds): {w['geomean']:.4f}x [{w['low']:.4f} - {w['high']:.4f}]",
                 f"{r['seed_goodput_behind']} of {r['seed_groups']}"]
        else:
            g = ["-", "-", "-"]
        out.append("| " + " | ".join([r["policy"], str(r["cells"]), *b, *f, *g]) + " |")
    return out


def format_seed_groups(rows: Sequence[Mapping[str, Any]], alpha: float = 3.0) -> list[str]:
    """Per mars policy and seed group (two or more seeds): the geometric mean speedup over the fastest
    baseline and its 95 % interval over the seeds, and the mean goodput difference to the best baseline
    with its interval; ``behind`` where the whole interval is below 1.0 (below 0 for goodput), ``ahead``
    where it is above."""
    def verdict(lo: float, hi: float, par: float) -> str:
        return "behind" if hi < par else "ahead" if lo > par else "within noise"

    out = [(f"| policy | group | seeds | vs the fastest baseline: geometric mean | 95 % CI over the seeds | verdict "
           f"| goodput@{alpha:g} minus the best baseline's (workflows/s) | 95 % CI | verdict |"),
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for g in r.get("seed_detail", ()):
            out.append(f"| {r['policy']} | {g['group']} | {g['seeds']} | {g['geomean']:.4f}x "
                       f"| {g['low']:.4f} - {g['high']:.4f} | {verdict(g['low'], g['high'], 1.0)} "
                       f"| {g['goodput_diff']:+.5f} | {g['goodput_low']:+.5f} - {g['goodput_high']:+.5f} "
                       f"| {verdict(g['goodput_low'], g['goodput_high'], 0.0)} |")
    return out
