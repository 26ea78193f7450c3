"""``run_experiment``: every cell of an experiment through the one driver (``run_policies``).

Layout under ``out``: ``runs/workloads/`` (materialised JSONL per workload and seed),
``runs/<workload>/rps<R>/seed<S>/<policy>/`` (run dirs) with ``cell.json`` per cell,
``cost_model.json`` (the T_ideal cost model shared by every cell), and the results
(``results.json``, ``table.md``, plots; see :mod:`vllm_mars.experiment.results`).

Resumable: a run whose dir has ``summary.json`` is finished and is read, not re-run, so a second
invocation runs only what is missing; a run ``results.json`` records without a run dir (a fresh
clone) is finished too, and its record stays in the results beside the runs made here. ``jobs > 1`` runs cells in parallel processes (spawned).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vllm_mars.driver.compare import run_policies
from vllm_mars.driver.runner import ReplayConfig
from vllm_mars.experiment.figures import run_figure_data, workload_stats
from vllm_mars.experiment.results import redraw_results, write_results
from vllm_mars.experiment.spec import Cell, Experiment, WorkloadSpec
from vllm_mars.metrics.compare import compare_record, record_speedup
from vllm_mars.metrics.ideal import CostModel
from vllm_mars.workload.ilr import generate, load_preset
from vllm_mars.workload.schema import load_workload, write_workload
from vllm_mars.workload.weka import DEFAULT_MAX_TOOL_S, convert_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Materialized:
    path: str
    roots: int
    dropped_over_context: int


def select_cells(exp: Experiment, only: Sequence[str] | None) -> list[Cell]:
    """The experiment's cells whose key (``WORKLOAD/rpsR/seedS``) matches any glob of ``only``."""
    cells = exp.cells()
    if not only:
        return cells
    picked = [c for c in cells if any(fnmatch.fnmatchcase(c.key, pat) for pat in only)]
    if not picked:
        raise ValueError(f"--only {','.join(only)} matches no cell; cells look like {cells[0].key}")
    return picked


def _params(w: WorkloadSpec, seed: int, n: int | None) -> dict[str, Any]:
    return {"preset": w.preset, "path": w.path, "weka": w.weka, "scale": w.scale, "seed": seed,
            "num_workflows": n, "max_context": w.max_context, "max_tool_s": w.max_tool_s}


def materialize(w: WorkloadSpec, seed: int, n: int | None, out: Path) -> Materialized:
    """The schema-v1 JSONL a cell replays: the preset generated with the cell's seed (so seeds are
    independent samples of the regime), the weka traces converted, or the JSONL file as is; roots
    above ``max_context`` dropped. Cached under ``out/runs/workloads`` by its parameters."""

    params = _params(w, seed, n)
    if w.path and w.max_context is None:
        return Materialized(w.path, -1, 0)
    digest = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    path = out / "runs" / "workloads" / f"{w.name}_seed{seed}_{digest}.jsonl"
    meta = path.with_suffix(".json")
    if path.is_file() and meta.is_file():
        m = json.loads(meta.read_text())
        return Materialized(str(path), m["roots"], m["dropped_over_context"])
    if w.preset:

        roots = generate(load_preset(w.preset, num_workflows=n, scale=w.scale, seed=seed))
    elif w.weka:

        roots = convert_dir(w.weka, scale=w.scale or 1.0, max_tool_s=w.max_tool_s or DEFAULT_MAX_TOOL_S)
    else:
        roots = load_workload(w.path)
    kept = [r for r in roots if w.max_context is None or max(
        x.peak_context_tokens() for x in r.walk()) <= w.max_context]
    if not kept:
        raise ValueError(f"workload {w.name}: every root exceeds max_context={w.max_context}")
    write_workload(path, kept)
    m = {"roots": len(kept), "dropped_over_context": len(roots) - len(kept), "params": params}
    meta.write_text(json.dumps(m, indent=2) + "\n")
    return Materialized(str(path), len(kept), len(roots) - len(kept))


def cell_dir(out: Path, cell: Cell) -> Path:
    return out / "runs" / cell.workload.name / f"rps{cell.rps:g}" / f"seed{cell.seed}"


def cell_config(exp: Experiment, cell: Cell, mat: Materialized) -> ReplayConfig:
    """The cell's replay. A generated preset is replayed whole: its ``num_workflows`` roots were drawn
    once, and those left after ``max_context`` are the cell's (not cycled back up to the count)."""
    w = cell.workload
    n = mat.roots if w.preset else exp.num_workflows(w)
    return replace(exp.base, workload=mat.path, seed=cell.seed, arrival=w.arrival or exp.base.arrival,
                   num_workflows=n, progress=False)


def finished_policies(exp: Experiment, out: Path, cell: Cell) -> list[str]:
    """The cell's policies whose run dir has ``summary.json``, in the file's order."""
    d = cell_dir(out, cell)
    return [p for p in exp.policies_for(cell.workload) if (d / p / "summary.json").is_file()]


def is_finished(exp: Experiment, out: Path, cell: Cell, recorded: dict[str, dict[str, Any]] | None = None) -> bool:
    """Every policy of the cell finished here or recorded without a run dir (``recorded``: :func:`recorded_runs`)."""
    kept = (recorded or {}).get(cell.key, {}).get("policies") or {}
    return len({*finished_policies(exp, out, cell), *kept}) == len(exp.policies_for(cell.workload))


def _run_cell(cfg: ReplayConfig, run: Sequence[str], policies: Sequence[str], variants: dict, rps: float, d: Path,
              cost: CostModel | None) -> tuple[dict, dict, CostModel | None, float]:
    """Run ``run`` (unfinished ones) in one cell; returns every finished policy's summary (module level:
    also the body of a worker process)."""

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.monotonic()
    _, _, cost = run_policies(cfg, run, rps, d, cost, variants, resume=True)
    done = [p for p in policies if (d / p / "summary.json").is_file()]
    summaries, dirs, _ = run_policies(cfg, done, rps, d, cost, variants, resume=True)  # reads only
    return summaries, dirs, cost, time.monotonic() - t0


def _cell_record(cell: Cell, mat: Materialized, summaries: dict, dirs: dict, wall_s: float,
                 figures: bool = False) -> dict[str, Any]:
    """The cell's record; with ``figures``, also what the paper's figures read of each run (per
    policy ``figure``) and of the workload (``workload_stats``, from its first run)."""
    rec = compare_record(cell.workload.name, {cell.rps: summaries}, {cell.rps: dirs})["cells"][0]
    out = {"key": cell.key, "workload": cell.workload.name, "seed": cell.seed, **rec,
           "roots": mat.roots if mat.roots >= 0 else None, "dropped_over_context": mat.dropped_over_context,
           "wall_s": round(wall_s, 3)}
    if figures and dirs:
        for p, d in dirs.items():
            out["policies"][p]["figure"] = run_figure_data(d)
        out["workload_stats"] = workload_stats(next(iter(dirs.values())))
    return out


def _save_cell(d: Path, rec: dict[str, Any]) -> None:
    """Write ``cell.json``; ``wall_s`` adds up over the invocations that ran parts of the cell."""
    path = d / "cell.json"
    if path.is_file():
        rec["wall_s"] = round(rec["wall_s"] + json.loads(path.read_text()).get("wall_s", 0.0), 3)
    path.write_text(json.dumps(rec, indent=2) + "\n")


def _load_cost(out: Path) -> CostModel | None:
    p = out / "cost_model.json"
    return CostModel.from_dict(json.loads(p.read_text()), where=str(p)) if p.is_file() else None


def recorded_runs(exp: Experiment, out: Path) -> dict[str, dict[str, Any]]:
    """The runs ``out/results.json`` records that have no run dir under ``out/runs`` (a fresh clone
    has results.json but no run dirs; an unfinished run dir is run again), per cell key: the recorded
    cell with only those policies in ``policies``. They count as finished (``--rerun`` runs one again) and stay in the results written
    now, beside the runs whose dirs are here. A policy the file no longer runs in that cell (a variant
    removed or renamed) is the file's change: its runs leave the table."""
    p = out / "results.json"
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}  # not ours to read back; it is rewritten from the run dirs
    recorded = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(recorded, list):
        return {}
    by_key = {c.key: c for c in exp.cells()}
    kept: dict[str, dict[str, Any]] = {}
    for rec in recorded:
        cell = by_key.get(rec.get("key")) if isinstance(rec, dict) else None
        if cell is None or not isinstance(rec.get("policies"), dict):
            continue
        runs = {q: d for q, d in rec["policies"].items() if q in exp.policies_for(cell.workload)
                and not (cell_dir(out, cell) / q).is_dir()}
        if runs:
            kept[cell.key] = {**rec, "policies": runs}
    return kept


def _with_recorded(exp: Experiment, cell: Cell, rec: dict[str, Any] | None,
                   recorded: dict[str, Any] | None) -> dict[str, Any] | None:
    """The cell's record from its run dirs (``rec``, cell.json) joined with its recorded runs whose dirs
    are gone (``recorded``); the speedup is taken again over both. ``carried_wall_s``: the wall
    seconds of the recorded runs, which no cell.json here counts."""
    if not recorded:
        return rec
    runs = {**recorded["policies"], **((rec or {}).get("policies") or {})}
    labels = exp.policies_for(cell.workload)
    runs = {q: runs[q] for q in labels if q in runs}
    carried = recorded.get("carried_wall_s", recorded.get("wall_s") or 0.0)
    out = {**recorded, **(rec or {}), "policies": runs,
           "speedup": None, "baseline": None, "baseline_mean_e2e_s": None, "mars_mean_e2e_s": None}
    out.update(record_speedup(runs, lambda q: (exp.variants.get(q) or {}).get("policy", q)))
    out["wall_s"] = round(((rec or {}).get("wall_s") or 0.0) + carried, 3)
    out["carried_wall_s"] = carried
    return out


def run_experiment(exp: Experiment, out: str | Path, only: Sequence[str] | None = None, jobs: int = 1,
                   progress: bool = True, policies: Sequence[str] | None = None,
                   execute: bool = True, rerun: Sequence[str] = ()) -> dict[str, Any]:
    """Run the selected cells' unfinished runs (of ``policies`` only, when given); then write the
    results of every cell with a finished run (``execute=False``: run nothing, only rewrite the cell
    records and results; where ``out`` has no run dirs at all, as on a fresh clone, only redraw the
    table and plots from ``out/results.json``). ``rerun``: policies whose finished runs in the selected
    cells are deleted first and run again (after a change to the code or the defaults they run on).
    Returns the results record (``results.json``)."""

    out = Path(out)
    if not execute and not rerun and not (out / "runs").is_dir() and (out / "results.json").is_file():
        return redraw_results(exp, out)
    out.mkdir(parents=True, exist_ok=True)
    cells = select_cells(exp, only)
    for flag, names in (("--policies", policies or ()), ("--rerun", rerun)):
        unknown = [p for p in names if p not in exp.policies]
        if unknown:
            raise ValueError(f"{flag}: {unknown[0]!r} is not a policy of {exp.path}; its policies: "
                             f"{', '.join(exp.policies)}")
    if policies is not None:
        policies = [*policies, *(p for p in rerun if p not in policies)]
    if rerun and not execute:
        raise ValueError("--rerun runs the policies again; it cannot go with --report")
    for cell in cells:
        for p in rerun:
            d = cell_dir(out, cell) / p
            if p in exp.policies_for(cell.workload) and d.is_dir():
                shutil.rmtree(d)
    recorded = recorded_runs(exp, out)
    for cell in cells:  # a recorded run --rerun names is run again
        for p in rerun:
            recorded.get(cell.key, {}).get("policies", {}).pop(p, None)
    bar = _bar(len(cells), exp.name, progress)
    cost = _load_cost(out)
    mats: dict[tuple[str, int], Materialized] = {}
    todo: list[tuple[Cell, ReplayConfig, list[str]]] = []
    for cell in cells:
        key = (cell.workload.name, cell.seed)
        if key not in mats:
            mats[key] = materialize(cell.workload, cell.seed, exp.num_workflows(cell.workload), out)
        cfg = cell_config(exp, cell, mats[key])
        kept = (recorded.get(cell.key) or {}).get("policies") or {}
        run = [p for p in exp.policies_for(cell.workload) if (policies is None or p in policies) and p not in kept]
        done = finished_policies(exp, out, cell)
        rec = cell_dir(out, cell) / "cell.json"
        if not execute:
            run = [p for p in run if p in done]
        if not run or (set(run) <= set(done) and rec.is_file()
                       and set(json.loads(rec.read_text())["policies"]) == set(done)
                       and (not exp.figures or "workload_stats" in json.loads(rec.read_text()))):
            bar.update(1)
            continue
        todo.append((cell, cfg, run))
    logger.info("%d of %d cells to run", len(todo), len(cells))

    def finish(cell: Cell, res: tuple) -> None:
        nonlocal cost
        summaries, dirs, c, wall = res
        if c is not None and cost is None:
            cost = c
            (out / "cost_model.json").write_text(json.dumps(c.as_dict(), indent=2) + "\n")
        _save_cell(cell_dir(out, cell), _cell_record(cell, mats[(cell.workload.name, cell.seed)], summaries,
                                                     dirs, wall, figures=bool(exp.figures)))
        bar.set_postfix_str(cell.key)
        bar.update(1)

    if todo and jobs > 1 and cost is None and exp.base.calibrate:
        cell, cfg, run = todo[0]  # one run first: it calibrates the cost model every process then shares
        bar.set_postfix_str(f"calibrating on {cell.key}")
        _, _, cost, _ = _run_cell(cfg, run[:1], run[:1], exp.variants, cell.rps, cell_dir(out, cell), cost)
        if cost is not None:
            (out / "cost_model.json").write_text(json.dumps(cost.as_dict(), indent=2) + "\n")
    if not execute:
        jobs = 1  # reading summaries needs no worker processes
    while todo and jobs <= 1:
        cell, cfg, run = todo.pop(0)
        bar.set_postfix_str(f"running {cell.key}")
        finish(cell, _run_cell(cfg, run, exp.policies_for(cell.workload), exp.variants, cell.rps,
                               cell_dir(out, cell), cost))
    if todo:

        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = {pool.submit(_run_cell, cfg, run, exp.policies_for(cell.workload), exp.variants, cell.rps,
                                cell_dir(out, cell), cost): cell for cell, cfg, run in todo}
            for f in as_completed(futs):
                finish(futs[f], f.result())
    bar.close()
    records = []
    for cell in exp.cells():
        p = cell_dir(out, cell) / "cell.json"
        rec = _with_recorded(exp, cell, json.loads(p.read_text()) if p.is_file() else None, recorded.get(cell.key))
        if rec is not None:
            records.append(rec)
    return write_results(exp, out, records, cost)


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...
    def close(self) -> None: ...


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoBar()

    return tqdm(total=total, desc=desc, unit="cell", dynamic_ncols=True, leave=True)
