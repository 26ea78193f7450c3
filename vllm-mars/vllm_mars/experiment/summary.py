"""Mars and its variants over many cells: the ratios the READMEs and RESULTS.md quote.

Per mars policy (``mars`` and every ``mars-*`` label) over the cells of one or more
``results.json`` files (``mars experiment summary``):

* its speedup over the fastest baseline of each cell (that baseline's mean E2E over its own): the
  geometric mean, the lowest (and where), how many cells are below ``1 - tolerance``;
* how many cells its goodput is more than ``tolerance`` below the best baseline's;
* its speedup over a reference policy (``mars`` by default): geometric mean, range, identical cells.

A baseline is what the experiment's table counts as one (:func:`vllm_mars.metrics.compare.is_baseline`,
a labelled variant's driver policy read from the file's ``config.variants``), or only those named
with ``baselines``. Reads only the files (no run dirs), so it works on committed results.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_mars.metrics.compare import is_baseline


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def policy_summary(records: Sequence[Mapping[str, Any]], ref: str = "mars",
                   baselines: Sequence[str] | None = None, only: Sequence[str] | None = None,
                   alpha: float = 3.0, tolerance: float = 0.01) -> list[dict[str, Any]]:
    """One row per mars policy (every label that is not a baseline) present in the selected cells,
    in first-seen order."""
    gkey = f"goodput_wps_alpha{float(alpha)}"  # as results.json writes it (goodput_wps_alpha3.0)
    cells = []  # (EXPERIMENT:KEY, the cell's policies, label -> is a baseline)
    for rec in records:
        name = rec.get("experiment", "?")
        variants = (rec.get("config") or {}).get("variants") or {}
        for c in rec["cells"]:
            key = f"{name}:{c['key']}"
            if only and not any(fnmatch.fnmatchcase(c["key"], g) or fnmatch.fnmatchcase(key, g) for g in only):
                continue
            is_base = {p: is_baseline(p, (variants.get(p) or {}).get("policy")) for p in c["policies"]}
            cells.append((key, c["policies"], is_base))
    order: list[str] = []
    for _, pol, is_base in cells:
        order += [p for p in pol if not is_base[p] and p not in order]
    rows = []
    for p in order:
        vs_base, vs_ref, low_goodput, identical = [], [], 0, 0
        for key, pol, is_base in cells:
            mine = (pol.get(p) or {}).get("mean_e2e_s")
            if not mine:
                continue
            base = {b: v for b, v in pol.items() if is_base[b] and (baselines is None or b in baselines)
                    and v.get("mean_e2e_s")}
            if base:
                fastest = min(v["mean_e2e_s"] for v in base.values())
                vs_base.append((fastest / mine, key))
                best_g = max((v.get(gkey) or 0.0) for v in base.values())
                if (pol[p].get(gkey) or 0.0) < (1 - tolerance) * best_g:
                    low_goodput += 1
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
        if vs_ref:
            row.update(ref=ref, ref_cells=len(vs_ref), ref_geomean=_geomean(vs_ref), ref_min=min(vs_ref),
                       ref_max=max(vs_ref), identical=identical)
        rows.append(row)
    return rows


def format_policy_summary(rows: Sequence[Mapping[str, Any]], tolerance: float = 0.01) -> list[str]:
    below = f"{1 - tolerance:g}x"
    out = [(f"| policy | cells | vs the fastest baseline: geometric mean | lowest (cell) | cells below {below} "
           f"| goodput more than {tolerance:.0%} below the best baseline's | vs reference: geometric mean (min - max) "
           "| identical to the reference |"),
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "geomean" in r:
            b = [f"{r['geomean']:.4f}x", f"{r['lowest']:.4f}x ({r['lowest_cell']})", str(r["below"]),
                 str(r["goodput_below"])]
        else:
            b = ["-"] * 4
        if "ref" in r:
            f = [f"{r['ref_geomean']:.4f}x ({r['ref_min']:.4f} - {r['ref_max']:.4f}) vs {r['ref']}",
                 f"{r['identical']} of {r['ref_cells']}"]
        else:
            f = ["-", "-"]
        out.append("| " + " | ".join([r["policy"], str(r["cells"]), *b, *f]) + " |")
    return out
