"""``mars profile``: time a real engine over a grid of batches, fit a step-time profile, write it."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

from vllm_mars.engine.local import SCHEDULER_CLS, on_cpu
from vllm_mars.driver.profiler import GRIDS, profile_engine
from vllm_mars.tiny_model import build_tiny_model

#: engine limits of a CPU profile: `mars replay`'s defaults, so the sim and the real engine agree
CPU_LIMITS = {"block_size": 32, "max_model_len": 2048, "max_num_batched_tokens": 1024, "max_num_seqs": 32,
              "num_blocks": 96}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="time a real engine's steps over a grid and fit a step-time profile for --backend sim",
        description="Run the real vLLM engine (in this process: the CPU engine with the tiny model by default, "
                    "a GPU where present), time its steps in `mars replay`'s serving loop over a grid of "
                    "(prefill chunk, context) and (decode batch, context) points, fit the profile's coefficients (mfu, attn_mfu, bw_eff, "
                    "per-step and per-request overhead) and write a profile file the sim accepts. Prints the "
                    "fit error per grid point.")
    p.add_argument("--model", default=None,
                   help="model dir (default: the base profile's model with --base, else the tiny CPU model)")
    p.add_argument("--base", default=None,
                   help="profile (name or file) giving the hardware, model shape and engine limits to keep "
                        "(default: a nominal CPU description with `mars replay`'s engine limits)")
    p.add_argument("--name", default=None, help="name of the written profile (default cpu-tiny, or the base's)")
    p.add_argument("--grid", choices=sorted(GRIDS), default=None,
                   help="grid of points (default: cpu on a CPU, gpu with --base)")
    p.add_argument("--repeats", type=int, default=None, help="runs of each point (default: the grid's)")
    p.add_argument("--dummy-weights", action="store_true",
                   help="random weights, no tokenizer (vLLM load_format=dummy): profile a config-only model "
                        "dir; implied when the model dir has no weight files")
    p.add_argument("--out", default=None, help="profile file to write, .toml or .json (default: NAME.toml)")
    p.add_argument("--samples-out", default=None, help="also write the timed steps as JSON lines here")
    p.add_argument("--loss", choices=("relative", "absolute"), default=None,
                   help="fit relative step errors (default for a grid; outliers down-weighted) or seconds "
                        "(default with --from-steps: unbiased for the total time a workload spends)")
    p.add_argument("--from-steps", nargs="+", metavar="JSONL", default=None,
                   help="fit recorded steps instead of running the engine: steps.jsonl of `mars replay "
                        "--record-steps` runs (or --samples-out files); the base profile gives the shape")
    p.add_argument("--from-kernels", nargs=2, metavar=("GPU", "MODEL"), default=None,
                   help="build the profile from NVIDIA's measured vLLM kernel tables (aiconfigurator-core, the "
                        "'kernels' extra) instead of running an engine: GPU h100, h200 or b200; MODEL a shipped "
                        "model (qwen3-coder-30b-a3b, qwen3-32b, llama-3.1-8b, gpt-oss-120b) or a config-only "
                        "model dir; writes JSON")
    p.add_argument("--tp", type=int, default=1, help="with --from-kernels: tensor-parallel degree (default 1)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "fp8"), default="auto",
                   help="with --from-kernels: GEMM/MoE precision of the tables (default auto: the checkpoint's)")
    p.add_argument("--scheduling", choices=("sync", "async"), default=None,
                   help="with --from-kernels: vLLM's scheduling mode the step times model (default async, as "
                        "vLLM 0.32 runs on a GPU: the CPU work overlaps the kernels; sync: "
                        "--no-async-scheduling, the CPU overheads between steps)")
    p.add_argument("--seed", type=int, default=0, help="prompt token seed (default 0)")
    p.set_defaults(func=_profile)


def _base_profile(args: argparse.Namespace, model: str | None):
    from vllm_mars.sim.profile import Efficiency, Hardware, Profile, available_models, load_profile

    if args.base:
        base = load_profile(args.base)
        return base, model or base.model_dir()
    if model is None:
        model = str(build_tiny_model())
    shipped = _shipped_model_name(model, available_models())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hw = Hardware(name=f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()} (nominal peaks)",
                  peak_flops=1e11, hbm_bandwidth=1e10, hbm_bytes=mem)
    base = Profile(name=args.name or "cpu-tiny", model=shipped or str(Path(model).resolve()), hardware=hw,
                   efficiency=Efficiency(mfu=1.0, bw_eff=1.0, attn_mfu=1.0), **CPU_LIMITS)
    return base, model


def _shipped_model_name(model: str, names: list[str]) -> str | None:
    """The shipped config-only model dir whose config.json has the same shape as ``model``'s."""
    from vllm_mars.sim.profile import MODELS_DIR
    from vllm_mars.sim.shapes import ModelShape

    try:
        shape = ModelShape.from_model_dir(model)
    except ValueError:
        return None
    return next((n for n in names if ModelShape.from_model_dir(MODELS_DIR / n) == shape), None)


def _from_kernels(args: argparse.Namespace) -> int:
    from vllm_mars.sim.profile import Profile

    gpu, model = args.from_kernels
    if args.tp < 1:
        raise ValueError(f"--tp {args.tp}: must be >= 1")
    if args.out and Path(args.out).suffix != ".json":
        raise ValueError(f"--out {args.out}: a kernel-table profile is written as .json")
    prof = Profile.from_kernels(gpu, model, tp=args.tp, dtype=args.dtype, name=args.name, scheduling=args.scheduling)
    out = Path(args.out or f"{prof.name}.json")
    prof.write(out)
    print(f"{prof.name}: KV pool {prof.kv_capacity_tokens()} tokens, max_model_len {prof.max_model_len}; "
          f"prefill 8192 tokens {prof.step_seconds([(8192, 0)], []) * 1e3:.1f} ms, decode 64 x 4096 "
          f"{prof.step_seconds([], [4096] * 64) * 1e3:.2f} ms\n{prof.kernels.source}\nwrote {out}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    if args.from_kernels:
        return _from_kernels(args)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: must be >= 1")

    from vllm_mars.sim.fit import fit_profile

    if args.model is not None and not (Path(args.model) / "config.json").exists():
        raise FileNotFoundError(f"--model {args.model}: no config.json there")
    base, model = _base_profile(args, args.model)
    gpu = args.base is not None and not base.hardware.name.upper().startswith("CPU")  # a GPU base profile
    grid = GRIDS[args.grid or ("gpu" if gpu else "cpu")]
    if args.repeats is not None:
        grid = replace(grid, repeats=args.repeats)
    chunk, ctx, batch = grid.needs()
    kw = {"block_size": base.block_size, "max_model_len": max(base.max_model_len, ctx) if not gpu else base.max_model_len,
              "max_num_batched_tokens": max(base.max_num_batched_tokens, chunk),
              "max_num_seqs": max(base.max_num_seqs, batch), "policy": "fcfs"}
    if gpu:
        # synchronous scheduling, so each timed step() is exactly the batch it scheduled (async scheduling
        # would overlap the next schedule with this forward pass; the sim has no overlap either)
        kw.update(num_blocks=None, kv_cache_memory_bytes=None, gpu_memory_utilization=base.gpu_memory_utilization,
                  scheduler_cls=SCHEDULER_CLS, async_scheduling=False)
    else:  # enough KV for the largest decode point, whatever the profile's own pool
        kw.update(num_blocks=max(base.num_kv_blocks(), -(-2 * batch * ctx // base.block_size)))
    has_weights = any(Path(model).glob("*.safetensors")) or any(Path(model).glob("*.bin"))
    if args.dummy_weights or not has_weights:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    t0 = dt.datetime.now(dt.UTC)
    if args.from_steps:
        from vllm_mars.sim.fit import load_samples

        samples = [s for path in args.from_steps for s in load_samples(path)]
        source = (f"fitted by `mars profile --from-steps` to {len(args.from_steps)} recorded run(s) at "
                  f"{t0:%Y-%m-%d %H:%M} UTC")
    else:
        if gpu and on_cpu():
            raise ValueError(f"--base {args.base}: profiling a GPU profile ({base.hardware.name}) needs a CUDA build of vLLM on a GPU "
                             "host (this vLLM runs on CPU); --from-steps fits recorded steps anywhere")
        print(f"profiling {model} on {base.hardware.name}: grid {args.grid or ('gpu' if gpu else 'cpu')} "
              f"(repeats {grid.repeats})", file=sys.stderr)
        samples = profile_engine(model, grid, engine_kw=kw, seed=args.seed,
                                 progress=lambda m: print(f"  {m}", file=sys.stderr))
        source = (f"fitted by `mars profile` (steps timed in the serving loop) on {platform.node()} "
                  f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}) at {t0:%Y-%m-%d %H:%M} UTC")
    result = fit_profile(base, samples, source=source,
                         loss=args.loss or ("absolute" if args.from_steps else "relative"))
    prof = result.profile
    if args.name:
        prof = prof.with_efficiency(prof.efficiency, name=args.name)
    desc = base.description.replace(" (efficiency priors, not fitted)", "") or base.hardware.name
    prof = prof.with_efficiency(prof.efficiency, description=f"{desc}; efficiency {source}")
    out = Path(args.out or f"{prof.name}.toml")
    prof.write(out)
    if args.samples_out:
        with open(args.samples_out, "w") as f:
            f.writelines(json.dumps({"label": s.label, "prefill": s.prefill, "decode": s.decode,
                                    "seconds": s.seconds}) + "\n" for s in samples)
    print(result.table())
    e = prof.efficiency
    print(f"\nmfu {e.mfu:.4g}  attn_mfu {e.attn_mfu:.4g}  bw_eff {e.bw_eff:.4g}  step overhead "
          f"{e.step_overhead_s * 1e3:.3f} ms  per request {e.per_seq_overhead_s * 1e6:.1f} us "
          f"(peaks: {base.hardware.peak_flops:.3g} FLOP/s, {base.hardware.hbm_bandwidth:.3g} B/s)")
    print(f"wrote {out}")
    return 0
