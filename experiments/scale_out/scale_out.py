"""Run the scale-out experiment one run at a time, recording each run's wall and CPU time, and write
its table (``scale_out.md`` beside ``results.json``).

    nice python experiments/scale_out/scale_out.py run    [--out DIR] [--work DIR] [--only N4,N16] [--policies mars-n4,...]
    python experiments/scale_out/scale_out.py report [--out DIR] [--work DIR] [--print-only]

``run`` calls ``mars experiment run --out WORK --only CELL --policies LABEL`` once per unfinished
run (a finished run is skipped, as by ``mars experiment run``), and appends ``{cell, policy, wall_s,
cpu_s}`` to ``OUT/costs.jsonl`` (CPU: user + system of that child process, vLLM's import and the
calibration included). The run dirs (hundreds of MB at 64 replicas) stay in WORK (default
``runs/experiments/scale_out``, not committed); OUT (``experiments/results/scale_out``) holds what is
committed. ``report`` reads WORK's run dirs (events.jsonl, summary.json) and the costs, and writes
OUT's ``results.json``, ``table.md``, plots, ``rows.json`` and ``scale_out.md``. A run recorded in
OUT but without a run dir in WORK (a run of an earlier session or machine) keeps its record: its
cell record from OUT's ``results.json`` and its table row from ``rows.json``; a run dir in WORK
replaces both.

Columns: workload (the ILR preset); admission (``per-replica``: one controller per replica; ``pooled``: one controller over the
summed reading, the runs up to commit 52035b3); mean / p95 admission wait (s: a root's arrival to
its start); mean / p95 E2E (s); goodput at alpha 3 (workflows/s finishing within 3 x T_ideal);
rebuilt tokens: tokens of a workflow's own previous context (its last call's prompt + output, in
full KV blocks) that its next call computed again because that KV had been evicted between the
turns, summed over every call, plus the tokens preemptions threw away (``recomputed_tokens``);
imbalance: max / mean over replicas of each replica's load, for three loads: roots placed on it,
busy seconds (virtual time its engine spent in steps) and time-mean KV usage (1.0 = even).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOML = HERE / "scale_out.toml"
DEFAULT_OUT = REPO / "experiments" / "results" / "scale_out"
DEFAULT_WORK = REPO / "runs" / "experiments" / "scale_out"


def _experiment():
    sys.path.insert(0, str(REPO / "vllm-mars"))
    from vllm_mars.experiment.spec import load_experiment

    return load_experiment(TOML)


def run(out: Path, work: Path, only: list[str] | None, policies: list[str] | None) -> None:
    from vllm_mars.experiment.grid import cell_dir

    exp = _experiment()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if (out / "cost_model.json").is_file() and not (work / "cost_model.json").is_file():
        # T_ideal (goodput) from the committed calibration, so new runs compare with the recorded ones
        shutil.copy(out / "cost_model.json", work / "cost_model.json")
    for cell in exp.cells():
        if only and cell.workload.name not in only and cell.key not in only:
            continue
        for p in exp.policies_for(cell.workload):
            if policies and p not in policies:
                continue
            if (cell_dir(work, cell) / p / "summary.json").is_file():
                continue
            cmd = [sys.executable, "-m", "vllm_mars.cli", "experiment", "run", str(TOML), "--out", str(work),
                   "--only", cell.key, "--policies", p, "--no-progress"]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.monotonic()
            print(f"{time.strftime('%H:%M:%S')} {cell.key} {p} ...", flush=True)
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            wall = time.monotonic() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            rec = {"cell": cell.key, "policy": p, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg_1m": os.getloadavg()[0]}
            with open(out / "costs.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"  wall {wall:.0f} s, cpu {cpu:.0f} s", flush=True)


def scan_events(events: Path, block_size: int) -> tuple[int, list[float]]:
    """Rebuilt tokens (each workflow's previous context, full blocks, that its next call did not find
    cached) and every root's admission wait (``workflow_start`` minus its arrival, seconds)."""
    prev: dict[str, int] = {}
    total = 0
    waits: list[float] = []
    with open(events) as f:
        for line in f:
            if '"call_end"' in line:
                e = json.loads(line)
                if e.get("event") != "call_end":
                    continue
                w = e["workflow"]
                ctx = prev.get(w)
                if ctx is not None and e["prompt_tokens"] >= ctx:
                    total += max(0, ((ctx - 1) // block_size) * block_size - (e.get("cached_tokens") or 0))
                prev[w] = e["prompt_tokens"] + e["output_tokens"]
            elif '"admission_wait_s"' in line:
                e = json.loads(line)
                if e.get("event") == "workflow_start" and e.get("admission_wait_s") is not None:
                    waits.append(e["admission_wait_s"])
    return total, waits


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))] if xs else float("nan")


HEAD = ["workload", "replicas", "roots/s per replica", "placement", "admission", "done", "mean adm. wait (s)",
        "p95 adm. wait (s)", "mean E2E (s)", "p95 E2E (s)", "goodput a=3 (wf/s)", "rebuilt (M tok)", "prefix hit",
        "imb. roots", "imb. busy", "imb. KV", "virtual s", "wall s", "CPU s"]


def _row(d: Path, cell, p: str, cost: dict) -> list[str]:
    """One run's table row (HEAD's columns) from its run dir."""
    s = json.loads((d / "summary.json").read_text())
    rc = json.loads((d / "run_config.json").read_text())
    cl = (s.get("engine") or {}).get("cluster") or {}
    imb = cl.get("imbalance") or {}
    rebuilt, waits = scan_events(d / "events.jsonl", rc.get("block_size") or 16)
    n = rc.get("replicas") or 1
    # runs before per-replica admission (commit 52035b3 and earlier) had one pooled controller
    shape = "-" if n == 1 else cl.get("admission", "pooled")
    return [cell.workload.preset or cell.workload.name, str(n), f"{cell.rps / n:g}", cl.get("placement", "(one)"),
            shape, f"{s['completed']}/{s['workflows']}",
            f"{sum(waits) / len(waits):.1f}" if waits else "-", f"{_p95(waits):.1f}" if waits else "-",
            f"{s['e2e_s']['mean']:.1f}", f"{s['e2e_s']['p95']:.1f}",
            f"{s['goodput_wps']['3.0']:.3f}", f"{(rebuilt + (s.get('recomputed_tokens') or 0)) / 1e6:.2f}",
            f"{s['prefix_hit_rate']:.3f}",
            *(f"{imb[k]:.2f}" if imb.get(k) is not None else "-" for k in ("roots", "busy_s", "kv_mean")),
            f"{s['makespan_s']:.0f}", str(cost.get("wall_s", "-")), str(cost.get("cpu_s", "-"))]


def _merged_cells(exp, out: Path, work: Path) -> list[dict]:
    """Every cell's record for OUT's results.json: WORK's cell record (its runs' dirs are there) over
    the one OUT's results.json holds, per policy (a run without a dir in WORK keeps its record)."""
    from vllm_mars.experiment.grid import cell_dir

    kept: dict[str, dict] = {}
    if (out / "results.json").is_file():
        kept = {c["key"]: c for c in json.loads((out / "results.json").read_text()).get("cells", [])}
    cells = []
    for cell in exp.cells():
        p = cell_dir(work, cell) / "cell.json"
        fresh = json.loads(p.read_text()) if p.is_file() else None
        old = kept.get(cell.key)
        if fresh is None and old is None:
            continue
        rec = dict(fresh or old)
        pol = {**((old or {}).get("policies") or {}), **((fresh or {}).get("policies") or {})}
        rec["policies"] = {q: pol[q] for q in exp.policies_for(cell.workload) if q in pol}
        if rec.get("speedup") is not None:  # no `mars` label here, so no cell speedup to recompute
            raise ValueError(f"{cell.key}: a cell speedup cannot be merged across sessions")
        cells.append(rec)
    return cells


def report(out: Path, work: Path, write: bool = True) -> str:
    """The table of every recorded run (``scale_out.md``); with ``write``, also OUT's results.json,
    table.md, plots and rows.json, merged with what OUT recorded before (see the module doc)."""
    from vllm_mars.experiment.grid import cell_dir
    from vllm_mars.experiment.results import write_results
    from vllm_mars.metrics.ideal import CostModel

    exp = _experiment()
    costs: dict[tuple[str, str], dict] = {}
    if (out / "costs.jsonl").is_file():
        for line in (out / "costs.jsonl").read_text().splitlines():
            r = json.loads(line)
            costs[(r["cell"], r["policy"])] = r  # the last record of a run is its run dir's
    kept = json.loads((out / "rows.json").read_text())["rows"] if (out / "rows.json").is_file() else {}
    rows: dict[str, list[str]] = {}
    for cell in exp.cells():
        for p in exp.policies_for(cell.workload):
            d = cell_dir(work, cell) / p
            key = f"{cell.key}/{p}"
            if (d / "summary.json").is_file():
                rows[key] = _row(d, cell, p, costs.get((cell.key, p), {}))
            elif key in kept:
                rows[key] = kept[key]
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in rows.values()]
    text = "\n".join(lines) + "\n"
    if write:
        c = next((d / "cost_model.json" for d in (out, work) if (d / "cost_model.json").is_file()), None)
        cost = CostModel.from_dict(json.loads(c.read_text()), where=str(c)) if c else None
        write_results(exp, out, _merged_cells(exp, out, work), cost)
        (out / "rows.json").write_text(json.dumps({"columns": HEAD, "rows": rows}, indent=0) + "\n")
        (out / "scale_out.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "report"))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the committed results (default %(default)s)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="the run dirs (default %(default)s)")
    ap.add_argument("--only", help="workload names (N1,N4,...) or cell keys (N4/rps1.6/seed0), comma-separated")
    ap.add_argument("--policies", help="variant labels, comma-separated")
    ap.add_argument("--print-only", action="store_true",
                    help="report: print the table, write nothing (e.g. --work DIR of another checkout)")
    a = ap.parse_args()
    if a.what == "run":
        run(a.out, a.work, a.only.split(",") if a.only else None, a.policies.split(",") if a.policies else None)
    print(report(a.out, a.work, write=not a.print_only), end="")


if __name__ == "__main__":
    main()
