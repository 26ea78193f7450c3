"""Run the scale-out experiment one run at a time, recording each run's wall and CPU time, and write
its table (``scale_out.md`` beside ``results.json``).

    nice python experiments/scale_out/scale_out.py run    [--out DIR] [--only N4,N16] [--policies mars-n4,...]
    python experiments/scale_out/scale_out.py report [--out DIR] [--print-only]

``run`` calls ``mars experiment run --only CELL --policies LABEL`` once per unfinished run (a
finished run is skipped, as by ``mars experiment run``), and appends ``{cell, policy, wall_s,
cpu_s}`` to ``DIR/costs.jsonl`` (CPU: user + system of that child process, vLLM's import and
the calibration included). ``report`` reads the run dirs (events.jsonl, summary.json) and the costs.

Columns: admission (``per-replica``: one controller per replica; ``pooled``: one controller over the
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
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOML = HERE / "scale_out.toml"
DEFAULT_OUT = REPO / "experiments" / "results" / "scale_out"


def _experiment():
    sys.path.insert(0, str(REPO / "vllm-mars"))
    from vllm_mars.experiment.spec import load_experiment

    return load_experiment(TOML)


def run(out: Path, only: list[str] | None, policies: list[str] | None) -> None:
    from vllm_mars.experiment.grid import cell_dir

    exp = _experiment()
    out.mkdir(parents=True, exist_ok=True)
    for cell in exp.cells():
        if only and cell.workload.name not in only and cell.key not in only:
            continue
        for p in exp.policies_for(cell.workload):
            if policies and p not in policies:
                continue
            if (cell_dir(out, cell) / p / "summary.json").is_file():
                continue
            cmd = [sys.executable, "-m", "vllm_mars.cli", "experiment", "run", str(TOML), "--out", str(out),
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


def report(out: Path, write: bool = True) -> str:
    from vllm_mars.experiment.grid import cell_dir

    exp = _experiment()
    costs: dict[tuple[str, str], dict] = {}
    if (out / "costs.jsonl").is_file():
        for line in (out / "costs.jsonl").read_text().splitlines():
            r = json.loads(line)
            costs[(r["cell"], r["policy"])] = r
    rows = []
    for cell in exp.cells():
        for p in exp.policies_for(cell.workload):
            d = cell_dir(out, cell) / p
            if not (d / "summary.json").is_file():
                continue
            s = json.loads((d / "summary.json").read_text())
            rc = json.loads((d / "run_config.json").read_text())
            eng = s.get("engine") or {}
            cl = eng.get("cluster") or {}
            imb = cl.get("imbalance") or {}
            rebuilt, waits = scan_events(d / "events.jsonl", rc.get("block_size") or 16)
            c = costs.get((cell.key, p), {})
            n = rc.get("replicas") or 1
            # runs before per-replica admission (commit 52035b3 and earlier) had one pooled controller
            shape = "-" if n == 1 else cl.get("admission", "pooled")
            rows.append([str(n), f"{cell.rps / n:g}", cl.get("placement", "(one)"), shape,
                         f"{s['completed']}/{s['workflows']}",
                         f"{sum(waits) / len(waits):.1f}" if waits else "-", f"{_p95(waits):.1f}" if waits else "-",
                         f"{s['e2e_s']['mean']:.1f}", f"{s['e2e_s']['p95']:.1f}",
                         f"{s['goodput_wps']['3.0']:.3f}", f"{(rebuilt + (s.get('recomputed_tokens') or 0)) / 1e6:.2f}",
                         f"{s['prefix_hit_rate']:.3f}",
                         *(f"{imb[k]:.2f}" if imb.get(k) is not None else "-" for k in ("roots", "busy_s", "kv_mean")),
                         f"{s['makespan_s']:.0f}", str(c.get("wall_s", "-")), str(c.get("cpu_s", "-"))])
    head = ["replicas", "roots/s per replica", "placement", "admission", "done", "mean adm. wait (s)",
            "p95 adm. wait (s)", "mean E2E (s)", "p95 E2E (s)", "goodput a=3 (wf/s)",
            "rebuilt (M tok)", "prefix hit", "imb. roots", "imb. busy", "imb. KV", "virtual s", "wall s", "CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    if write:
        (out / "scale_out.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "report"))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", help="workload names (N1,N4,...) or cell keys (N4/rps1.6/seed0), comma-separated")
    ap.add_argument("--policies", help="variant labels, comma-separated")
    ap.add_argument("--print-only", action="store_true",
                    help="report: print the table, do not write scale_out.md (for run dirs of another checkout)")
    a = ap.parse_args()
    if a.what == "run":
        run(a.out, a.only.split(",") if a.only else None, a.policies.split(",") if a.policies else None)
    print(report(a.out, write=not a.print_only), end="")


if __name__ == "__main__":
    main()
