"""Sim fidelity: the same workloads through the real CPU engine (tiny model, wall time) and through the
sim (virtual time), per policy, repeated; errors of the sim's medians against the real runs' medians.

    PYTHONPATH=vllm-mars python benchmark/perf/sim_fidelity.py                   # real runs, grid fit, sims
    PYTHONPATH=vllm-mars python benchmark/perf/sim_fidelity.py --policies fcfs --workloads compact --repeats 2

Per workload (``compact``: the bundled default; ``ilr3``: ILR-3 cut to this engine, generated from
``sim_fidelity_ilr3.toml`` at ``--scale 80``; ``compact:K`` or ``ilr3:K``: that workload with its clock
stretched K times, every tool time and arrival gap x K, as ``cpu_default_rounds.py --stretch K``, so
``compact:0.2 --rps 20`` is compact on an engine 5x slower against its tools; or a path) and policy:

1. ``--repeats`` real runs (``mars replay --backend inprocess --record-steps``); their spread is the
   noise floor (a shared machine's changing load moves a real run's timing, and with it where KV
   runs out);
2. the trace check, per real run: the sim charged that run's own recorded step times, step by step,
   and taking each call in before the step the real engine took it in before (``--step-trace``). It
   must give the real run's preemptions and recomputed tokens exactly and its batches step for step:
   any difference is the sim's mechanism (event order, scheduling, KV sizing, an admission
   controller's choices), not its step-time model or the real driver's latencies;
3. the sim with a profile fitted to each real run's own steps (``mars profile --from-steps``);
4. the sim with the ``cpu`` grid fit of ``mars profile``, timed among the real runs (also under
   ``--real-only``; ``--profile`` gives another): one pass over the grid (``--grid-repeats`` runs of each
   point, default 1) after each repeat's real runs, all passes fitted together (``mars profile
   --from-steps --loss relative``). Its steps are timed in the same serving loop as the real runs', and
   over the same stretch of the box's changing state: a grid timed at another time describes that
   moment (q10: a grid fitted hours before on another load put all six grid errors +6 to +19 %; g20b:
   one grid of 3 repeats timed in the minute after the runs was 18 % faster than the runs' steps, the
   passes among them within 2 %; benchmark/perf/RESULTS.md, "Sim fidelity").

3 and 4 are medians over deterministic runs with the profile's step times scaled by each of
``--scales`` (default 0.98-1.02): the preemptions of one run are one draw of a quantity chaotic in
step time (a 1 % change moves them by up to 2x; E2E moves by about 1 %), as a real run's are.

Every sim run has the real runs' engine shape (KV blocks, block size, limits). Writes
results/sim_fidelity.json; errors are (sim - real) / real of medians over the repeats. Resumable: a
rerun with the same ``--out`` reuses finished real runs and the grid fit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmark" / "perf" / "results" / "sim_fidelity.json"
ILR3_PRESET = Path(__file__).resolve().parent / "sim_fidelity_ilr3.toml"
ILR3_SCALE = 80
KEYS = ("mean_e2e_s", "p95_e2e_s", "mean_ttft_s", "preemptions", "recomputed_tokens", "prefix_hit_rate",
        "makespan_s")


def metrics(summary: dict) -> dict:
    return {"mean_e2e_s": summary["e2e_s"]["mean"], "p95_e2e_s": summary["e2e_s"]["p95"],
            "mean_ttft_s": summary["ttft_s"]["mean"], "preemptions": summary.get("preemptions") or 0,
            "recomputed_tokens": summary.get("recomputed_tokens") or 0,
            "prefix_hit_rate": summary.get("prefix_hit_rate"), "completed": summary.get("completed"),
            "makespan_s": summary.get("makespan_s")}


def median(runs: list[dict]) -> dict:
    out = {}
    for k in KEYS:
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def spread(runs: list[dict]) -> dict:
    """Largest relative distance of a run from the runs' median, per metric (0 for one run)."""
    med = median(runs)
    return {k: (round(max(abs(r[k] - med[k]) for r in runs) / med[k], 4) if med[k] else None)
            for k in ("mean_e2e_s", "preemptions", "recomputed_tokens")}


def rel(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else None
    return round((sim - real) / real, 4)


def errors(real: dict, sim: dict) -> dict:
    return {"mean_e2e_err": rel(sim["mean_e2e_s"], real["mean_e2e_s"]),
            "p95_e2e_err": rel(sim["p95_e2e_s"], real["p95_e2e_s"]),
            "preemptions_err": rel(sim["preemptions"], real["preemptions"]),
            "recomputed_tokens_err": rel(sim["recomputed_tokens"], real["recomputed_tokens"])}


def per_run_bias(pairs: list[tuple[float, float]]) -> dict:
    """Whether the sim misses a real run's count systematically: over (real count, median of the sims
    of that run's own fit) pairs, the mean log ratio sim / real and its standard error (runs with a
    zero on either side left out). A miss of the medians over a few repeats can be the real runs'
    own noise; a mean log ratio beyond about 2 standard errors is not."""
    logs = [math.log(s / r) for r, s in pairs if r > 0 and s > 0]
    if not logs:
        return {"runs": 0, "mean_log_ratio": None, "stderr": None}
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else None
    return {"runs": len(logs), "mean_log_ratio": round(statistics.fmean(logs), 4),
            "stderr": None if se is None else round(se, 4)}


def paired_gap(best: list[dict], other: list[dict]) -> dict:
    """Another policy's mean E2E against the best's, repeat by repeat (repeat i of each policy ran back
    to back, under the same load): :func:`per_run_bias` of the pairs (best, other)."""
    return per_run_bias([(a["mean_e2e_s"], b["mean_e2e_s"]) for a, b in zip(best, other)])


def pooled_bias(paths: list[str], runs: slice = slice(None)) -> dict:
    """:func:`per_run_bias` of each workload, policy and count over the runs of several results files
    (``runs``: those repeats of each file only, e.g. its first or second half, a held-out check)."""
    out: dict = {}
    for path in paths:
        for w, res in json.loads(Path(path).read_text()).items():
            if w.startswith("_"):
                continue
            for pol, r in res.items():
                per_run = {} if pol.startswith("_") else r["own_run_fit"].get("per_run") or {}
                for key, v in per_run.items():
                    out.setdefault(w, {}).setdefault(pol, {}).setdefault(key, []).extend(map(tuple, v["pairs"][runs]))
    return {w: {p: {k: per_run_bias(v) for k, v in ks.items()} for p, ks in ps.items()} for w, ps in out.items()}


def e2e_columns(res: dict, policies: list[str]) -> dict[str, dict[str, float]]:
    """Each policy's mean E2E in the real runs (median) and in both fits' sims (their medians)."""
    return {"real": {p: res[p]["real"]["mean_e2e_s"] for p in policies},
            "own_run_fit": {p: res[p]["own_run_fit"]["median"]["mean_e2e_s"] for p in policies},
            "grid_fit": {p: res[p]["grid_fit"]["sim"]["mean_e2e_s"] for p in policies}}


def table(doc: dict) -> str:
    """A results file as Markdown: errors of the medians in % (E2E in bold where within its target:
    5 % own-run fit, 15 % grid fit; counts target 20 %), each run against its own fit's sims (mean log
    ratio +- standard error, %), and the winners: each other policy behind the real one repeat by repeat,
    and every policy's mean E2E against the best in the real runs and both fits."""
    def pct(x, nd=0):
        return "-" if x is None else f"{x * 100:+.{nd}f}"

    def e2e(x, target):
        return pct(x, 1) if x is None or abs(x) > target else f"**{pct(x, 1)}**"

    def bias(b):
        return "-" if b["mean_log_ratio"] is None else f"{b['mean_log_ratio'] * 100:+.1f} +- {(b['stderr'] or 0) * 100:.1f}"

    rows = [("| workload, policy | real: preempt., recomp., E2E | spread: E2E, preempt., recomp. | own-run fit: "
             "preempt. / recomp. / E2E | grid fit: preempt. / recomp. / E2E | trace |"), "|---|---|---|---|---|---|"]
    per_run = ["| workload, policy | preempt. | recomp. | E2E |", "|---|---|---|---|"]
    wins = []
    for w, res in doc.items():
        if w.startswith("_"):
            continue
        for pol, r in res.items():
            if pol.startswith("_"):
                continue
            re_, sp, o, g = r["real"], r["real"]["spread"], r["own_run_fit"], r["grid_fit"]
            rows.append(f"| {w} {pol} | {re_['preemptions']:g}, {re_['recomputed_tokens']:g}, {re_['mean_e2e_s']:.2f} s "
                        f"| {sp['mean_e2e_s'] * 100:.0f} %, {sp['preemptions'] * 100:.0f} %, "
                        f"{sp['recomputed_tokens'] * 100:.0f} % | {pct(o['preemptions_err'])} / "
                        f"{pct(o['recomputed_tokens_err'])} / {e2e(o['mean_e2e_err'], 0.05)} | "
                        f"{pct(g['preemptions_err'])} / {pct(g['recomputed_tokens_err'])} / "
                        f"{e2e(g['mean_e2e_err'], 0.15)} | {r['trace']['exact']} of {r['trace']['of']} |")
            pr = o.get("per_run") or {}
            per_run.append(f"| {w} {pol} | " + " | ".join(bias(pr[k]) if k in pr else "-" for k in
                                                          ("preemptions", "recomputed_tokens", "mean_e2e_s")) + " |")
        wn = res.get("_winner") or {}
        if wn:
            pols = [p for p in res if not p.startswith("_")]
            best = res[wn["real"]]["real"]["runs"]
            gaps = [(p, paired_gap(best, res[p]["real"]["runs"])) for p in pols if p != wn["real"]]
            gap_s = ", ".join(f"{p} {bias(g)} %" for p, g in gaps if g["mean_log_ratio"] is not None)
            col = e2e_columns(res, pols)
            behind = "; ".join(f"{p} " + " / ".join(f"{(v[p] / min(v.values()) - 1) * 100:+.1f}" for v in col.values())
                               + " %" for p in pols)
            m = wn["margin"]
            wins.append(f"- {w}: real {wn['real']} (margin {m['real'] * 100:.1f} %, its runs' E2E spread "
                        f"{wn['real_spread_of_best'] * 100:.0f} %" + (f"; the others behind it, repeat by repeat: {gap_s}"
                                                                        if gap_s else "")
                        + f"), own-run fit {wn['own_run_fit']} ({m['own_run_fit'] * 100:.1f} %), grid fit "
                        f"{wn['grid_fit']} ({m['grid_fit'] * 100:.1f} %): " + ("same" if wn["same"] else "not the same")
                        + f". Mean E2E against the best, real / own-run fit / grid fit: {behind}")
    return "\n".join([*rows, "", ("Each run against its own fit's sims, mean log ratio sim / real +- standard error "
                                   "(%):"), "", *per_run, "", "Winners (lowest mean E2E):", "", *wins])


def margin(e2e: dict[str, float]) -> float | None:
    """Relative gap between the best and the second-best policy's mean E2E (None: one policy)."""
    v = sorted(e2e.values())
    return round((v[1] - v[0]) / v[0], 4) if len(v) > 1 and v[0] > 0 else None


def grid_pass(out: Path, i: int, grid: str, repeats: int | None) -> Path:
    """Pass ``i`` over `mars profile`'s grid now, on this machine (the CPU engine with the tiny model):
    its timed steps, ``grid_steps-p<i>.jsonl`` in ``out`` (kept: a rerun reuses it)."""
    from vllm_mars.cli import main as mars

    steps = out / f"grid_steps-p{i}.jsonl"
    if not steps.exists():
        part = steps.with_suffix(".part")
        argv = ["profile", "--grid", grid, "--repeats", str(repeats or 1), "--out", str(out / "grid-pass.toml"),
                "--samples-out", str(part)]
        if mars(argv) != 0:
            raise SystemExit("mars profile failed")
        part.rename(steps)
    return steps


def fit_grid_profile(out: Path) -> Path:
    """The grid fit of every pass in ``out`` together (the grid's relative loss)."""
    from vllm_mars.cli import main as mars

    passes = sorted(out.glob("grid_steps-p*.jsonl"), key=lambda f: int(f.stem.rpartition("-p")[2]))
    path = out / "cpu-tiny-grid.toml"
    if mars(["profile", "--from-steps", *map(str, passes), "--loss", "relative", "--out", str(path)]) != 0:
        raise SystemExit("mars profile --from-steps failed")
    return path


def shaped(profile: str, cfg, dest: Path) -> Path:
    """The profile with the real run's engine shape (KV blocks, block size, limits) as the in-process
    engine resolves them (the CPU build's block size, the context limit the pool holds)."""
    from vllm_mars.driver.config import InProcessEngine
    from vllm_mars.engine.local import CPU_BLOCK_SIZE
    from vllm_mars.sim.profile import load_profile

    e = InProcessEngine.of(replace(cfg, backend="inprocess"))
    p = load_profile(profile)
    p = p.with_efficiency(p.efficiency, model=p.model_dir(), num_blocks=e.num_blocks,
                          block_size=e.block_size or CPU_BLOCK_SIZE, max_model_len=e.max_model_len,
                          max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens)
    return p.write(dest)


NAMED = ("compact", "ilr3")


def stretch_of(arg: str) -> tuple[str, float] | None:
    """``compact:K`` / ``ilr3:K`` -> (workload, K); None for a plain name or path. A bad K raises
    ValueError with a one-line message."""
    name, sep, k = arg.partition(":")
    if not sep or name not in NAMED:
        return None
    try:
        f = float(k)
    except ValueError:
        f = math.nan
    rounds = _rounds()
    if not rounds.stretch_in_range(f):
        lo, hi = rounds.STRETCH_RANGE
        raise ValueError(f"--workloads {arg!r}: {name}:K needs a clock stretch K in [{lo:g}, {hi:g}], got {k!r}")
    return name, f


def _rounds():
    """``cpu_default_rounds.py`` (beside this script): the clock stretch this tool's ``compact:K`` shares."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import cpu_default_rounds

    return cpu_default_rounds


def workload_name(arg: str) -> str:
    """A workload's folder in the work dir and key in the results: compact, ilr3, compact_s<K> for
    compact:K (the stem of the file ``cpu_default_rounds.stretch_workload`` writes), or a path's stem."""
    st = stretch_of(arg)
    if st:
        return f"{st[0]}_s{st[1]:g}"
    return arg if arg in NAMED else Path(arg).stem


def workload_file(name: str, out: Path) -> str:
    st = stretch_of(name)
    if st:
        path = out / f"{workload_name(name)}.jsonl"
        if not path.exists():
            _rounds().stretch_workload(workload_file(st[0], out), path, st[1])
        return str(path)
    if name == "compact":
        return str(ROOT / "benchmark" / "workloads" / "compact.jsonl")
    if name == "ilr3":
        path = out / "ilr3_cut.jsonl"
        if not path.exists():
            from vllm_mars.cli import main as mars

            if mars(["gen-workload", "--preset", str(ILR3_PRESET), "--scale", str(ILR3_SCALE), "-o", str(path)]):
                raise SystemExit("gen-workload failed")
        return str(path)
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="fcfs,mars,continuum")
    ap.add_argument("--workloads", default="compact,ilr3", help="compact, ilr3, compact:K / ilr3:K (the clock "
                    "stretched K times: tool times and arrival gaps x K) or JSONL paths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="real runs per workload and policy (medians, spread)")
    ap.add_argument("--rps", type=float, default=4.0)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, help="a fitted CPU profile for the grid-fit runs (default: the grid "
                    "fit in --out, of the grid passes timed among the real runs)")
    ap.add_argument("--grid", default="cpu", help="grid of the fit when --profile is not given")
    ap.add_argument("--grid-repeats", type=int, default=None,
                    help="runs of each grid point per pass (one pass after each repeat's real runs; default 1)")
    ap.add_argument("--scales", default="0.98,0.99,1,1.01,1.02",
                    help="step-time scales of each fitted profile's sim runs (own-run and grid fit), comma-separated; "
                         "the table takes their median (preemptions are chaotic in step time: one run is one draw; "
                         "'1': a single run each)")
    ap.add_argument("--real-only", action="store_true", help="only the real runs and the grid fit after them "
                    "(a later run with --no-new-real adds the sims)")
    ap.add_argument("--no-new-real", action="store_true", help="use the real runs already in --out (at most "
                    "--repeats each), start none")
    ap.add_argument("--out", default=None, help="work dir (default runs/sim_fidelity_<stamp>); a rerun with the same "
                    "dir reuses its finished real runs and grid fit")
    ap.add_argument("--results", default=str(RESULTS), help="JSON results file ('' = do not write)")
    ap.add_argument("--table", metavar="JSON", default=None, help="print a results file as Markdown tables (no runs)")
    ap.add_argument("--pool", nargs="+", metavar="JSON", default=None,
                    help="print the per-run count bias pooled over these results files (no runs)")
    ap.add_argument("--runs", metavar="A:B", default=None, help="with --pool: only repeats A to B-1 of each file "
                    "(e.g. 0:10 and 10:20, the halves of 20 repeats: does a bias on one hold on the other?)")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    if args.pool:
        runs = slice(None)
        if args.runs:
            a, sep, b = args.runs.partition(":")
            try:
                runs = slice(int(a) if a else None, int(b) if b else None)
            except ValueError:
                sep = ""
            if not sep:
                ap.error(f"--runs {args.runs!r}: A:B expected, repeats A to B-1 (integers, either may be empty)")
        print(json.dumps(pooled_bias(args.pool, runs), indent=2))
        return 0
    # name (the work dir's folder and the results' key) -> compact, ilr3, compact:K or a JSONL path
    try:
        workloads = {workload_name(w.strip()): w.strip() for w in args.workloads.split(",") if w.strip()}
    except ValueError as e:
        ap.error(str(e))
    absent = [w for w in workloads.values() if w not in NAMED and not stretch_of(w) and not Path(w).is_file()]
    if absent:
        ap.error(f"--workloads: no file {absent[0]!r}; compact, ilr3, compact:K, ilr3:K or a JSONL path expected")

    from vllm_mars.cli import main as mars
    from vllm_mars.driver.runner import ReplayConfig, run_replay
    from vllm_mars.sim.fit import load_samples, step_speed
    from vllm_mars.sim.profile import load_profile

    out = Path(args.out or f"runs/sim_fidelity_{time.strftime('%Y%m%d_%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    load0 = os.getloadavg()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    try:
        scales = [float(x) for x in args.scales.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--scales {args.scales!r}: comma-separated positive numbers expected")
    if not scales or not all(0 < f < 10 for f in scales):
        ap.error(f"--scales {args.scales!r}: comma-separated numbers in (0, 10) expected")

    def run(cfg) -> dict:
        d = Path(cfg.out)
        if not (d / "summary.json").exists() or (cfg.backend == "inprocess" and not (d / "steps.jsonl").exists()):
            d, _ = run_replay(cfg)
        return json.loads((d / "summary.json").read_text())

    def ensemble(cfg, prof: Path, dest: Path) -> list[dict]:
        """The sim with ``prof``'s step times scaled by each of --scales: one deterministic run is one
        draw (a 1 % change in step time moves a run's preemptions by up to 2x, its E2E by about 1 %),
        so the sims' median is compared with the real runs' median."""
        got = []
        for f in scales:
            p = prof if f == 1 else load_profile(str(prof)).with_step_scale(f).write(
                prof.with_name(f"{prof.stem}-x{f:g}{prof.suffix}"))
            got.append(metrics(run(replace(cfg, profile=str(p), out=str(dest) + (f"-x{f:g}" if f != 1 else "")))))
        return got

    # 1. the real runs, interleaved over workloads and policies (a load change hits every policy alike),
    # each repeat followed by a pass over the grid unless the grid fit is given or made already
    grid_fit = out / "cpu-tiny-grid.toml"
    passes = not (args.profile or args.no_new_real or grid_fit.exists())
    bases = {w: ReplayConfig(workload=workload_file(src, out), rps=args.rps, seed=args.seed,
                             num_blocks=args.num_blocks, progress=False, plots=False) for w, src in workloads.items()}
    real: dict = {}
    for i in range(args.repeats):
        for w, base in bases.items():
            for pol in policies:
                d = out / w / f"real-{pol}-r{i}"
                if args.no_new_real and not ((d / "summary.json").exists() and (d / "steps.jsonl").exists()):
                    continue
                s = run(replace(base, policy=pol, backend="inprocess", record_steps=True, out=str(d)))
                real.setdefault(w, {}).setdefault(pol, []).append((d, metrics(s)))
                print(f"real {w} {pol} r{i}: {metrics(s)}", file=sys.stderr)
        if passes:
            grid_pass(out, i, args.grid, args.grid_repeats)
    missing = [f"{w} {p}" for w in workloads for p in policies if not real.get(w, {}).get(p)]
    if missing:
        ap.error(f"no finished real runs (summary.json and steps.jsonl) in {out} for: {', '.join(missing)}")
    if args.profile:
        profile = args.profile
    elif grid_fit.exists():
        profile = str(grid_fit)
    elif not any(out.glob("grid_steps-p*.jsonl")):
        ap.error(f"--no-new-real: no grid fit {grid_fit} nor grid passes beside the real runs; give --profile, "
                 "or run without --no-new-real to time the grid among new real runs")
    else:
        profile = str(fit_grid_profile(out))
    if args.real_only:
        return 0
    # another profile's grid-fit sims go to their own folders (a rerun reuses finished runs by folder)
    tag = "" if Path(profile) == grid_fit else f"-{Path(profile).stem}"
    result: dict = {}
    for w, src in workloads.items():
        base = ReplayConfig(workload=workload_file(src, out), rps=args.rps, seed=args.seed, num_blocks=args.num_blocks,
                            progress=False, plots=False, backend="sim")
        grid_profile = shaped(profile, base, out / w / f"profile-grid{tag}.toml")
        res = result[w] = {}
        for pol in policies:
            runs = real[w][pol]
            trace, own = [], []
            for d, _ in runs:
                # 2. the trace check: the sim with this run's own recorded step times
                s = run(replace(base, policy=pol, profile=str(grid_profile), step_trace=str(d / "steps.jsonl"),
                                out=str(d.with_name(d.name.replace("real", "simtrace")))))
                trace.append({**metrics(s), "step_trace": (s.get("engine") or {}).get("step_trace")})
                # 3. a profile fitted to this run's own steps
                fit = d.with_name(d.name.replace("real", "fit") + ".toml")
                if mars(["profile", "--from-steps", str(d / "steps.jsonl"), "--out", str(fit)]) != 0:
                    raise SystemExit("mars profile --from-steps failed")
                prof = shaped(str(fit), base, fit)
                own += ensemble(replace(base, policy=pol), prof, d.with_name(d.name.replace("real", "simown")))
            # 4. the grid fit
            ens = ensemble(replace(base, policy=pol), grid_profile, out / w / f"simgrid{tag}-{pol}")
            grid = {**median(ens), "completed": ens[0]["completed"]}
            for d, m in runs:  # how slowly the engine ran in this run against the grid fit, batch for batch
                m["step_speed_vs_grid"] = round(step_speed(load_profile(str(grid_profile)),
                                                           load_samples(str(d / "steps.jsonl"), run_only=True)), 3)
            rm = median([m for _, m in runs])
            k = len(scales)  # each real run's own-fit sims: its count against the median of its sims
            pairs = {key: [(m[key], statistics.median(o[key] for o in own[i * k:(i + 1) * k]))
                           for i, (_, m) in enumerate(runs)] for key in ("preemptions", "recomputed_tokens", "mean_e2e_s")}
            res[pol] = {
                "real": {**rm, "runs": [m for _, m in runs], "spread": spread([m for _, m in runs])},
                # exact: every recorded step's batch was the sim's, so the same preemptions
                "trace": {"exact": sum(t["step_trace"]["mismatched_steps"] == 0 and t["preemptions"] == m["preemptions"]
                                       and t["recomputed_tokens"] == m["recomputed_tokens"]
                                       for t, (_, m) in zip(trace, runs)),
                          "of": len(runs), "runs": trace},
                "own_run_fit": {**errors(rm, median(own)), "median": median(own), "runs": own,
                                "per_run": {key: {"pairs": v, **per_run_bias(v)} for key, v in pairs.items()}},
                "grid_fit": {**errors(rm, grid), "sim": grid, "runs": ens},
            }
        e2e = e2e_columns(res, policies)
        best = {k: min(v, key=v.get) for k, v in e2e.items()}
        # the margin of the best policy over the next, against the real runs' own E2E spread and
        # against the noise of the real gap itself: repeat i of each policy ran back to back (the same
        # load), so the per-repeat log ratio second / best has a standard error
        order = sorted(policies, key=e2e["real"].get)
        paired = (paired_gap([m for _, m in real[w][order[0]]], [m for _, m in real[w][order[1]]])
                  if len(order) > 1 else None)
        res["_winner"] = {**best, "same": len(set(best.values())) == 1,
                          "margin": {k: margin(v) for k, v in e2e.items()},
                          "real_spread_of_best": res[best["real"]]["real"]["spread"]["mean_e2e_s"],
                          "real_paired_gap": paired}
    epochs = [json.loads((d / "events.jsonl").open().readline()).get("epoch") or 0 for w in workloads
              for p in policies for d, _ in real[w][p]]
    epochs = [e for e in epochs if e]
    result["_meta"] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0)), "machine": f"{platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})",
        "loadavg_start": [round(x, 1) for x in load0], "loadavg_end": [round(x, 1) for x in os.getloadavg()],
        "command": "PYTHONPATH=vllm-mars python benchmark/perf/sim_fidelity.py " + " ".join(argv or sys.argv[1:]),
        "workloads": list(workloads), "policies": policies,
        "real_runs": {w: {p: len(real[w][p]) for p in policies} for w in workloads},
        "real_runs_utc": [time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) for t in (min(epochs), max(epochs))]
        if epochs else None, "rps": args.rps,
        "num_blocks": args.num_blocks, "profile": profile, "scales": scales,
        "profile_source": load_profile(profile).efficiency.source,
        "wall_s": round(time.time() - t0, 1), "work_dir": str(out)}
    print(json.dumps(result, indent=2))
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
