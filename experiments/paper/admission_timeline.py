"""How an admission ran, from a run dir (the diagnosis in README.md, "Admission yardstick").

Per ``--bin`` seconds of the run: active and queued roots, running and waiting calls, KV usage, the
active roots' contexts over the pool (each root's latest prompt + output), and the tokens rebuilt
(a later turn's previous context not found cached); then the run's totals.

    python experiments/paper/admission_timeline.py RUN_DIR [RUN_DIR ...] [--bin 50]

``--probe`` runs the run dir's replay again (the sim is deterministic: the same run) and prints,
every 5 virtual seconds while roots wait, how mars's cost rule priced the oldest waiting root: the
projected life peak with it over the pool, its overflow beyond the pool per coming turn, its rebuild seconds (before the stall factor), the stall
factor ``1 + running`` and the slot wait it was held against.

    python experiments/paper/admission_timeline.py RUN_DIR --probe

``--waits`` prints, per root workflow in arrival order, its first prompt, LLM calls, admission wait
(arrival to start) and service (start to done) in each run dir given, then their means: where two
admissions of the same cell differ, waiting or running.

    python experiments/paper/admission_timeline.py RUN_DIR_A RUN_DIR_B --waits
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import defaultdict
from pathlib import Path

from vllm_mars.metrics.events import read_events


def timeline(run: Path, bin_s: float) -> None:
    events = read_events(run)
    cfg = json.loads((run / "run_config.json").read_text())
    pool = None
    ctx: dict[str, int] = {}
    active: set[str] = set()
    bins: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    rebuilt: dict[int, int] = defaultdict(int)
    total_rebuilt = total_prompt = 0
    for e in events:
        kind, b = e["event"], int(e["ts"] // bin_s)
        if kind == "workflow_arrive":
            ctx[e["workflow"]] = e["prefill_tokens"]
        elif kind == "workflow_start" and e.get("root") == e["workflow"]:
            active.add(e["workflow"])
        elif kind in ("workflow_done", "workflow_error") and e.get("root") == e["workflow"]:
            active.discard(e["workflow"])
        elif kind == "call_end":
            wf = e["workflow"]
            if e["turn"] > 0 and wf in ctx:
                lost = max(0, ctx[wf] - (e.get("cached_tokens") or 0))
                rebuilt[b] += lost
                total_rebuilt += lost
            ctx[wf] = e["prompt_tokens"] + e["output_tokens"]
            total_prompt += e["prompt_tokens"]
        elif kind == "kv_sample":
            if e.get("total_blocks") and e.get("block_size"):
                pool = e["total_blocks"] * e["block_size"]
            row = bins[b]
            for k in ("active", "queued", "running", "waiting", "kv_usage"):
                if e.get(k) is not None:
                    row[k].append(float(e[k]))
            if pool:
                row["over_pool"].append(sum(ctx.get(w, 0) for w in active) / pool)
    summary = json.loads((run / "summary.json").read_text())
    eng = summary.get("engine", {})
    print(f"== {run}  ({cfg.get('policy')}, admission options {cfg.get('admission_options') or {}})")
    print(f"   mean E2E {summary['e2e_s']['mean']:.1f} s, preemptions {eng.get('preemptions')}, recomputed "
          f"{eng.get('recomputed_tokens')}, rebuilt {total_rebuilt / 1e6:.2f}M tokens "
          f"({total_rebuilt / max(total_prompt, 1):.3f} of the prompts)")
    print("       t  active queued running waiting    kv  ctx/pool  rebuilt")

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    for b in sorted(set(bins) | set(rebuilt)):
        r = bins.get(b, {})
        print(f"  {b * bin_s:6.0f} {mean(r.get('active', [])):7.1f} {mean(r.get('queued', [])):6.1f} "
              f"{mean(r.get('running', [])):7.1f} {mean(r.get('waiting', [])):7.1f} {mean(r.get('kv_usage', [])):5.2f} "
              f"{mean(r.get('over_pool', [])):9.2f} {rebuilt.get(b, 0):8d}")


def _roots(run: Path) -> dict[str, tuple[float, int, float, float, int]]:
    """Root workflow -> (arrival, first prompt tokens, start, done, LLM calls)."""
    arr: dict[str, tuple[float, int]] = {}
    start: dict[str, float] = {}
    done: dict[str, float] = {}
    calls: dict[str, int] = defaultdict(int)
    for e in read_events(run):
        kind, wf = e["event"], e.get("workflow")
        if kind == "workflow_arrive":
            arr[wf] = (e["ts"], e["prefill_tokens"])
        elif kind == "workflow_start" and e.get("root") == wf:
            start[wf] = e["ts"]
        elif kind == "workflow_done" and e.get("root") == wf:
            done[wf] = e["ts"]
        elif kind == "call_end":
            calls[wf] += 1
    return {w: (a, p, start[w], done[w], calls[w]) for w, (a, p) in arr.items() if w in start and w in done}


def waits(runs: list[Path]) -> None:
    rows = [_roots(r) for r in runs]
    print("  ".join(f"[{i}] {r}" for i, r in enumerate(runs)))
    print("workflow     arrival  prompt calls " + "".join(f"  [{i}] wait  service" for i in range(len(runs))))
    sums = [[0.0, 0.0] for _ in runs]
    common = [w for w in rows[0] if all(w in r for r in rows)]
    for w in sorted(common, key=lambda w: rows[0][w][0]):
        a, p, _, _, n = rows[0][w]
        line = f"{w[-10:]:>10} {a:8.1f} {p:7d} {n:5d}"
        for i, r in enumerate(rows):
            _, _, st, dn, _ = r[w]
            sums[i][0] += st - a
            sums[i][1] += dn - st
            line += f"  {st - a:9.1f} {dn - st:8.1f}"
        print(line)
    n = max(len(common), 1)
    print("mean" + " " * 27 + "".join(f"  {w / n:9.1f} {s / n:8.1f}" for w, s in sums))


def probe(run: Path) -> None:
    from vllm_mars.admission.mars.controller import MarsAdmissionController
    from vllm_mars.driver.config import ReplayConfig
    from vllm_mars.driver.runner import run_replay

    rec = json.loads((run / "run_config.json").read_text())
    names = {f.name for f in dataclasses.fields(ReplayConfig)}
    out = run.parent / (run.name + "-probe")
    cfg = dataclasses.replace(ReplayConfig(**{k: v for k, v in rec.items() if k in names}), out=str(out),
                              progress=False)
    tick = MarsAdmissionController.tick
    last = [float("-inf")]

    def logged(self: MarsAdmissionController, now: float) -> list[str]:
        admitted = tick(self, now)
        cap = self.life_capacity_tokens()
        if self._queue and self.cost is not None and cap is not None and now - last[0] >= 5.0:
            last[0] = now
            root = next(iter(self._queue.values()))
            view = self._life_view()
            cand = (self._root_turns(root), float(self._est_tokens(root)))
            over = view.marginal_overflow(cand, cap)
            ctx = sum(c for _, c in view.items)
            print(f"  t {now:6.1f} active {len(self._active):2d} queued {len(self._queue):2d} ctx/pool {ctx / cap:4.2f} "
                  f"peak with it/pool {view.peak_with(cand) / cap:4.2f} "
                  f"candidate {cand[1]:7.0f} tokens {cand[0]:4.1f} turns, overflow turns {sum(1 for x in over if x > 0):2d}, "
                  f"rebuild {self._rebuild_s_total(root, 0, over):6.2f} s x stall {self._stall_factor():5.2f} "
                  f"vs slot wait {self._queue_cost_s(now):6.2f} s; admitted now {admitted}")
        return admitted

    MarsAdmissionController.tick = logged
    cost = None
    cm = run.parents[4] / "cost_model.json"  # an experiment's shared T_ideal calibration, if any
    if cm.is_file():
        from vllm_mars.metrics.ideal import CostModel
        cost = CostModel.from_dict(json.loads(cm.read_text()), where=str(cm))
    d, _ = run_replay(cfg, cost)
    print(f"  probe run: {d}, mean E2E {json.loads((d / 'summary.json').read_text())['e2e_s']['mean']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run dirs (events.jsonl, summary.json, run_config.json)")
    ap.add_argument("--bin", type=float, default=50.0, help="seconds per row (default 50)")
    ap.add_argument("--probe", action="store_true", help="re-run the replay and print the cost rule's holds")
    ap.add_argument("--waits", action="store_true", help="per root: admission wait and service in each run dir")
    a = ap.parse_args()
    if a.waits:
        waits(a.runs)
        return
    for run in a.runs:
        probe(run) if a.probe else timeline(run, a.bin)


if __name__ == "__main__":
    main()
