"""The online cost fit's prefill knee against the one a profile measures.

`mars serve` without ``--cost-model`` prices with ``OnlineCostFit``, a linear least-squares fit of
the engine's own step times; the mars work-conserving quanta beside decodes read its knee
(``CostModel.free_prefill_tokens``: the prefill tokens a step's fixed cost is worth). A linear fit
has no knee of its own, only its overhead over its cost per token, so this script measures how far
that lands from the knee ``Profile.cost_model`` measures (the line through a 32-token and a
half-budget prefill step of the profile).

For each case it replays a generated ILR workload with ``mars`` in virtual time on a shipped GPU
profile (the sim), records every step the engine runs (its prefill chunks, its decoding calls and
the profile's time for it), feeds them in order to an ``OnlineCostFit`` as the scheduler would, and
reports the knee of every refit (each 16 steps once 32 are seen): median, 10th and 90th
percentiles, and the last, beside the profile's; and the same fits' price of rebuilding a
16k-token context over the profile fit's (median and lowest). Deterministic (virtual time, fixed
seeds).

    .venv/bin/python benchmark/perf/online_knee.py                      # both cases below
    .venv/bin/python benchmark/perf/online_knee.py --case h200 --workflows 20

``--steps FILE ...`` fits recorded steps of a real engine instead (a run's ``steps.jsonl``, or
``cpu_default_rounds.py --keep-steps`` output), each file on its own, with nothing forgotten: the
cost model that engine's own steps give, beside ``--reference`` (a profile or CostModel JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

REBUILD_TOKENS = 16384
#: name -> (profile, preset, workflows, roots/s, max context or None)
CASES = {
    "h200": ("h200-qwen3-coder-30b-a3b", "ILR-3", 30, 0.08, None),
    "h100": ("h100-qwen3-32b", "ILR-1", 12, 0.036, 16384),
}


def run_case(profile_name: str, preset: str, workflows: int, rps: float, max_context: int | None,
             seed: int) -> dict:
    from vllm_mars.costmodel import OnlineCostFit
    from vllm_mars.driver.runner import ReplayConfig, run_replay
    from vllm_mars.engine import rig
    from vllm_mars.experiment.grid import materialize
    from vllm_mars.experiment.spec import WorkloadSpec
    from vllm_mars.sim.engine import SimBackend
    from vllm_mars.sim.profile import load_profile

    profile = load_profile(profile_name)
    reference = profile.cost_model()
    measured = reference.free_prefill_tokens()
    steps: list[tuple[list[tuple[int, int]], int]] = []
    shape = rig.batch_shape

    def recording_shape(s, so):  # the sim engine's view of each step it runs
        prefill, decode = shape(s, so)
        steps.append((list(prefill), list(decode)))
        return prefill, decode

    tmp = Path(tempfile.mkdtemp(prefix="mars-online-knee-"))
    # the workload an experiment cell of these parameters replays (roots over max_context dropped)
    wl = materialize(WorkloadSpec(name=preset, rps=(rps,), preset=preset, max_context=max_context), seed,
                     workflows, tmp)
    cfg = ReplayConfig(workload=wl.path, policy="mars", rps=rps, backend="sim", profile=profile_name,
                       seed=seed, calibrate=False, progress=False, out=str(tmp / "run"))
    rig.batch_shape = recording_shape
    # every step through the scheduler, as the online fit sees them (the sim's decode fast-forward runs
    # decode-only steps without describing each batch; its results are the same)
    fast, SimBackend.fast_forward = SimBackend.fast_forward, False
    try:
        run_replay(cfg)
    finally:
        rig.batch_shape = shape
        SimBackend.fast_forward = fast
    fit = OnlineCostFit()
    knees, rebuilds = [], []
    for prefill, decode in steps:
        if not prefill and not decode:
            continue
        fit.observe(profile.step_seconds(prefill, decode), prefill, len(decode))
        if fit.steps % 16 == 0 and (model := fit.model()) is not None:
            knees.append(model.free_prefill_tokens())
            rebuilds.append(model.rebuild_s(REBUILD_TOKENS) / reference.rebuild_s(REBUILD_TOKENS))
    if not knees:
        raise SystemExit(f"{profile_name}: too few steps for an online fit ({len(steps)})")
    q = statistics.quantiles(knees, n=10)
    return {"profile": profile_name, "workload": f"{preset} x{wl.roots} @ {rps} roots/s, seed {seed}",
            "steps": len(steps), "refits": len(knees), "profile_knee": measured,
            "online_knee_median": round(statistics.median(knees)), "online_knee_p10": round(q[0]),
            "online_knee_p90": round(q[-1]), "online_knee_last": knees[-1],
            "median_over_profile": round(statistics.median(knees) / measured, 2),
            # refits whose knee is past the step budget: no linear prefill cost found
            "refits_knee_over_budget": sum(k > profile.max_num_batched_tokens for k in knees),
            # the same fits' price of rebuilding a 16k-token context, over the profile fit's
            "rebuild_16k_over_profile_median": round(statistics.median(rebuilds), 2),
            "rebuild_16k_over_profile_min": round(min(rebuilds), 3)}


def fit_steps(path: str, reference=None) -> dict:
    """A recorded run's steps (``steps.jsonl``, read by ``vllm_mars.sim.fit.load_samples``) fitted
    by ``OnlineCostFit`` without forgetting."""
    from vllm_mars.costmodel import OnlineCostFit
    from vllm_mars.sim.fit import load_samples

    try:
        samples = load_samples(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"not recorded steps: {e}") from None
    fit = OnlineCostFit(forget=1.0)
    for x in samples:
        fit.observe(x.seconds, x.prefill, len(x.decode))
    m = fit.model()
    if m is None:
        raise SystemExit(f"{path}: too few steps with prefill work for a fit ({fit.steps} steps)")
    rec = {"steps_file": path, "steps": fit.steps, "step_overhead_ms": round(m.step_overhead_s * 1e3, 3),
           "prefill_s_per_token": float(f"{m.prefill_s_per_token:.3g}"),
           "attn_s_per_token_ctx": float(f"{m.attn_s_per_token_ctx:.3g}"),
           "rebuild_1000_ms": round(m.rebuild_s(1000) * 1e3, 2), "knee": m.free_prefill_tokens()}
    if reference is not None:
        rec["reference_rebuild_1000_ms"] = round(reference.rebuild_s(1000) * 1e3, 2)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=(*CASES, "all"), default="all")
    ap.add_argument("--workflows", type=int, default=None, help="override the case's workflow count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", nargs="+", metavar="FILE", help="fit these recorded steps instead (no sim run)")
    ap.add_argument("--reference", metavar="FILE", help="with --steps: a profile or CostModel JSON to set beside")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.steps:
        from vllm_mars.sim.profile import load_cost_model

        ref = load_cost_model(args.reference) if args.reference else None
        for path in args.steps:
            print(json.dumps(fit_steps(path, ref)))
        return
    for name in CASES if args.case == "all" else (args.case,):
        profile, preset, n, rps, max_context = CASES[name]
        rec = run_case(profile, preset, args.workflows or n, rps, max_context, args.seed)
        print(json.dumps(rec))


if __name__ == "__main__":
    main()
