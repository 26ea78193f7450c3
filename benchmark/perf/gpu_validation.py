"""Table-built GPU profiles against published end-to-end vLLM runs (aiconfigurator-core's
``systems/silicon_sample.csv``): TTFT and TPOT of a closed-loop ``vllm bench serve`` run, emulated
through the sim itself.

Each published row is one ``vllm bench serve`` run: ``--max-concurrency C`` clients, random prompts of
ISL tokens, OSL output tokens (``ignore_eos``), on one GPU x model x TP. Here: the same closed loop of C
clients over the sim backend (``vllm_mars.sim.engine.SimBackend``: vLLM's real scheduler, fcfs, with
the profile's KV pool and step times) on the virtual-time loop, ``--prompts-per-client`` prompts per
client (no prefix shared between prompts), then mean TTFT and mean TPOT (``(e2e - ttft) / (OSL - 1)``)
as ``vllm bench serve`` reports them. The clients are staggered over one request's life and each one's
first request is warm-up: the steady state of a long run, whose request jitter keeps clients out of
phase (a deterministic sim would otherwise keep C equal requests in lock step, every prefill a burst). Repeated published runs of one configuration are taken at
their median.

Covered rows: every vLLM aggregated-serving row whose model has a shipped config (Qwen3-32B bf16,
gpt-oss-120b MXFP4) on a GPU we have figures for (H100, H200, B200). Rows of FP8 checkpoints
(Llama-3.1-8B-Instruct-FP8, Qwen3-32B-FP8) are not covered: our profiles are bf16.

    python benchmark/perf/gpu_validation.py --out benchmark/perf/results/gpu_validation.json
    python benchmark/perf/gpu_validation.py --fit-overheads   # the once-fitted overheads (sim/kernels.py)

Needs the ``kernels`` extra (aiconfigurator-core); no network, no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "vllm-mars"))

from vllm_mars.sim.engine import SimBackend
from vllm_mars.sim.loop import run_virtual
from vllm_mars.sim.profile import Profile

#: published model id (and precision) -> shipped model dir
MODELS = {("Qwen/Qwen3-32B", ""): "qwen3-32b", ("openai/gpt-oss-120b", "fp4"): "gpt-oss-120b"}
SYSTEMS = {"h100_sxm": "h100", "h200_sxm": "h200", "b200_sxm": "b200"}
#: the once-fitted overheads are fitted on these rows only (the rest are out of sample)
FIT_SET = ("h100", "qwen3-32b")


@dataclass(frozen=True)
class Row:
    """One published configuration (median over its repeated runs)."""

    gpu: str
    model: str
    tp: int
    isl: int
    osl: int
    concurrency: int
    ttft_ms: float
    tpot_ms: float
    runs: int
    vllm: str
    ids: tuple[str, ...]


def silicon_csv() -> Path:
    """The installed aiconfigurator-core's published end-to-end table."""
    return Path(str(files("aiconfigurator_core") / "systems" / "silicon_sample.csv"))


def covered_rows(path: Path | None = None) -> list[Row]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    with open(path or silicon_csv()) as f:
        for r in csv.DictReader(f):
            model = MODELS.get((r["model_path"], r["precision"]))
            gpu = SYSTEMS.get(r["system"])
            if r["backend"] != "vllm" or r["mode"] != "agg" or model is None or gpu is None:
                continue
            key = (gpu, model, int(r["tp_size"]), int(r["isl"]), int(r["osl"]), int(r["batch_size"]))
            groups[key].append(r)
    out = []
    for (gpu, model, tp, isl, osl, c), rs in sorted(groups.items()):
        out.append(Row(gpu, model, tp, isl, osl, c, statistics.median(float(r["silicon_ttft_ms"]) for r in rs),
                       statistics.median(float(r["silicon_tpot_ms"]) for r in rs), len(rs),
                       ",".join(sorted({r["backend_version"] or "?" for r in rs})), tuple(r["id"] for r in rs)))
    return out


def emulate(profile: Profile, isl: int, osl: int, concurrency: int, prompts_per_client: int = 3,
            seed: int = 0) -> dict[str, float]:
    """Mean TTFT and TPOT (ms) of a closed loop of ``concurrency`` clients over the sim backend."""

    async def run() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        backend = SimBackend(profile, loop.time, policy="fcfs", seed=seed,
                             max_model_len=max(profile.max_model_len, isl + osl))
        await backend.start()
        rng = random.Random(seed)
        vocab = backend.vocab_size
        ttft, tpot = [], []

        # A long benchmark run's clients are out of phase (request jitter spreads them); clients that
        # start together with equal lengths would stay in lock step in a deterministic sim. So client k
        # starts k/C of one request's estimated life late, and its first request is warm-up.
        life = profile.step_seconds([(isl, 0)], []) + (osl - 1) * profile.step_seconds([], [isl] * concurrency)

        async def client(k: int) -> None:
            await asyncio.sleep(life * k / concurrency)
            for j in range(prompts_per_client):
                ids = [rng.randrange(1, vocab) for _ in range(isl)]
                t0 = loop.time()
                res = await backend.generate(f"c{k}-{j}", ids, osl, {}, ignore_eos=True)
                if j > 0:
                    ttft.append(res.first_token_ts - t0)
                    tpot.append((res.end_ts - res.first_token_ts) / max(osl - 1, 1))

        try:
            await asyncio.gather(*(client(k) for k in range(concurrency)))
            stats = backend.engine_stats()
        finally:
            await backend.close()
        return {"ttft_ms": statistics.fmean(ttft) * 1e3, "tpot_ms": statistics.fmean(tpot) * 1e3,
                "preemptions": float(stats.get("preemptions", 0)), "steps": float(backend.steps)}

    return run_virtual(run())


_PROFILES: dict[tuple, Profile] = {}


def profile_for(row: Row, overheads: tuple[float, float] | None = None) -> Profile:
    key = (row.gpu, row.model, row.tp)
    if key not in _PROFILES:
        _PROFILES[key] = Profile.from_kernels(row.gpu, row.model, tp=row.tp)
    p = _PROFILES[key]
    if overheads is not None:
        from dataclasses import replace

        p = p.with_efficiency(replace(p.efficiency, step_overhead_s=overheads[0], per_seq_overhead_s=overheads[1]))
    return p


def validate(rows: list[Row], prompts_per_client: int, overheads: tuple[float, float] | None = None,
             progress=None) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        t0 = time.process_time()
        p = profile_for(row, overheads)
        got = emulate(p, row.isl, row.osl, row.concurrency, prompts_per_client)
        rec = {**{k: getattr(row, k) for k in ("gpu", "model", "tp", "isl", "osl", "concurrency", "runs", "vllm")},
               "ttft_public_ms": round(row.ttft_ms, 3), "ttft_ms": round(got["ttft_ms"], 3),
               "ttft_ratio": round(got["ttft_ms"] / row.ttft_ms, 4),
               "tpot_public_ms": round(row.tpot_ms, 3), "tpot_ms": round(got["tpot_ms"], 3),
               "tpot_ratio": round(got["tpot_ms"] / row.tpot_ms, 4), "preemptions": int(got["preemptions"]),
               "kv_tokens": p.kv_capacity_tokens(), "cpu_s": round(time.process_time() - t0, 2)}
        out.append(rec)
        if progress:
            progress(f"[{i + 1}/{len(rows)}] {row.gpu} {row.model} tp{row.tp} {row.isl}/{row.osl} c{row.concurrency}: "
                     f"TTFT {rec['ttft_ratio']:.3f}x TPOT {rec['tpot_ratio']:.3f}x ({rec['cpu_s']} s)")
    return out


def summary(records: list[dict]) -> list[dict]:
    """Median and worst |ratio - 1| per GPU x model, TTFT and TPOT apart."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        by[(r["gpu"], r["model"])].append(r)
    out = []
    for (gpu, model), rs in sorted(by.items()):
        row = {"gpu": gpu, "model": model, "rows": len(rs)}
        for q in ("ttft", "tpot"):
            ratios = [r[f"{q}_ratio"] for r in rs]
            row[f"{q}_median_ratio"] = round(statistics.median(ratios), 3)
            row[f"{q}_median_abs_err"] = round(statistics.median(abs(x - 1) for x in ratios), 3)
            worst = max(ratios, key=lambda x: max(x, 1 / x))
            row[f"{q}_worst_ratio"] = round(worst, 3)
        out.append(row)
    return out


def fit_overheads(rows: list[Row], prompts_per_client: int, progress=None) -> tuple[float, float]:
    """Least squares of the published TPOT minus the overhead-free sim TPOT on (1, concurrency): a
    step's fixed cost adds about itself to every output token's time, a request's cost about
    concurrency x itself (every running request is in every decode step)."""
    import numpy as np

    recs = validate(rows, prompts_per_client, overheads=(0.0, 0.0), progress=progress)
    a = np.array([[1.0, r["concurrency"]] for r in recs])
    b = np.array([(r["tpot_public_ms"] - r["tpot_ms"]) / 1e3 for r in recs])
    w = 1.0 / np.array([r["tpot_public_ms"] / 1e3 for r in recs])  # relative errors
    from vllm_mars.sim.fit import nnls

    coef = nnls(a * w[:, None], b * w)
    return float(coef[0]), float(coef[1])


def markdown(path: str) -> str:
    """The RESULTS.md / docs/sim.md tables of a results file: per GPU x model, then per row."""
    d = json.loads(Path(path).read_text())
    out = [("| GPU | model | rows | TTFT median ratio | TTFT median abs err | TTFT worst | TPOT median ratio | "
           "TPOT median abs err | TPOT worst |"), "|---|---|---|---|---|---|---|---|---|"]
    for s in d["summary"]:
        out.append(f"| {s['gpu']} | {s['model']} | {s['rows']} | {s['ttft_median_ratio']} | {s['ttft_median_abs_err']} | "
                   f"{s['ttft_worst_ratio']} | {s['tpot_median_ratio']} | {s['tpot_median_abs_err']} | "
                   f"{s['tpot_worst_ratio']} |")
    out += ["", "| GPU | model | TP | ISL/OSL | C | vLLM | TTFT public ms | ours | ratio | TPOT public ms | ours | ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["records"]:
        out.append(f"| {r['gpu']} | {r['model']} | {r['tp']} | {r['isl']}/{r['osl']} | {r['concurrency']} | {r['vllm']} | "
                   f"{r['ttft_public_ms']:.1f} | {r['ttft_ms']:.1f} | {r['ttft_ratio']:.2f} | {r['tpot_public_ms']:.2f} | "
                   f"{r['tpot_ms']:.2f} | {r['tpot_ratio']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", nargs="*", default=None, help="only these GPUs (h100 h200 b200)")
    ap.add_argument("--model", nargs="*", default=None, help="only these models (qwen3-32b gpt-oss-120b)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="skip rows above this concurrency")
    ap.add_argument("--max-osl", type=int, default=None, help="skip rows with longer outputs (CPU time)")
    ap.add_argument("--stride", type=int, default=1,
                    help="every Nth covered row per GPU x model (CPU time on a shared machine; default all)")
    ap.add_argument("--prompts-per-client", type=int, default=3,
                    help="requests per client; the first is warm-up (default 3)")
    ap.add_argument("--fit-overheads", action="store_true",
                    help=f"fit the per-step and per-request overheads on the {' x '.join(FIT_SET)} rows and print them")
    ap.add_argument("--out", default=None, help="write the records and summary here (JSON)")
    ap.add_argument("--markdown", metavar="JSON", default=None, help="print the tables of a results file and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    rows = covered_rows()
    if args.gpu:
        rows = [r for r in rows if r.gpu in args.gpu]
    if args.model:
        rows = [r for r in rows if r.model in args.model]
    if args.max_concurrency:
        rows = [r for r in rows if r.concurrency <= args.max_concurrency]
    if args.max_osl:
        rows = [r for r in rows if r.osl <= args.max_osl]
    if args.stride > 1:
        by_pair: dict[tuple, list[Row]] = defaultdict(list)
        for r in rows:
            by_pair[(r.gpu, r.model)].append(r)
        rows = [r for rs in by_pair.values() for r in rs[::args.stride]]

    def say(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    if args.fit_overheads:
        fit = [r for r in rows if (r.gpu, r.model) == FIT_SET]
        o, s = fit_overheads(fit, args.prompts_per_client, progress=say)
        print(json.dumps({"step_overhead_s": o, "per_seq_overhead_s": s, "rows": len(fit)}))
        return 0
    records: list[dict] = []

    def write() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(
                {"command": " ".join(["python benchmark/perf/gpu_validation.py", *(argv or sys.argv[1:])]),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows_planned": len(rows),
                 "summary": summary(records), "records": records}, indent=1) + "\n")

    for row in rows:  # one at a time, written as it goes (a long run on a shared machine)
        records += validate([row], args.prompts_per_client, progress=say)
        write()
    for s in summary(records):
        print(json.dumps(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
