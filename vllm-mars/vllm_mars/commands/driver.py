"""``mars replay``, ``mars compare`` and ``mars report``: the task driver's commands."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path


def _kv(items: list[str] | None, flag: str) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _floats(s: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {s!r}: expected comma-separated numbers") from None
    if not vals:
        raise ValueError(f"{flag} {s!r}: expected positive numbers")
    if flag == "--rps":
        from vllm_mars.config import check_rps

        for v in vals:
            check_rps(flag, v)
    elif any(not v > 0 or not math.isfinite(v) for v in vals):
        raise ValueError(f"{flag} {s!r}: expected positive finite numbers")
    return vals


def _common(p: argparse.ArgumentParser, compare: bool) -> None:
    from vllm_mars.driver.runner import DEFAULT_WORKLOAD, SIM_MAX_KV_BLOCKS, ReplayConfig

    d = ReplayConfig()  # the one place the driver's engine and tool defaults live

    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD),
                   help="schema-v1 JSONL workload (default: the bundled benchmark/workloads/compact.jsonl)")
    p.add_argument("--num-workflows", type=int, default=None,
                   help="root workflows to run (default: all in the file; more cycles the file, each "
                        "repeat with its own task and turn tokens)")
    p.add_argument("--arrival", choices=("fixed", "poisson", "trace"), default="fixed",
                   help="arrival process: fixed i/rps, poisson at rate rps, or the workload's arrival_s")
    p.add_argument("--seed", type=int, default=0, help="token-id and Poisson seed (default 0)")
    p.add_argument("--model", default=None, help="model dir (default: the tiny CPU model); for --backend http "
                                                  "the served model name (default: the server's first)")
    p.add_argument("--profile", default=None,
                   help="step-time profile for --backend sim (shipped name, e.g. h200-qwen3-coder-30b-a3b, or a "
                        "profile file); it sets the KV pool and the engine limits below")
    from vllm_mars.engine import local

    cpu_blocks = local.COMPARE_CPU_NUM_BLOCKS if compare else local.DRIVER_CPU_NUM_BLOCKS
    p.add_argument("--num-blocks", type=int, default=None,
                   help=f"KV blocks of the in-process engine (default: {cpu_blocks} on the CPU build, small = KV "
                        "pressure; vLLM's own sizing on GPU; 0 = vLLM's own sizing); with --backend sim: the KV "
                        "pool instead of the profile's, with the profile's step times")
    p.add_argument("--kv-scale", type=float, default=None,
                   help="--backend sim: the KV pool = this x the profile's blocks, step times unchanged (e.g. 10 "
                        "for the no-thrash limit of a workload; at most "
                        f"{SIM_MAX_KV_BLOCKS:,} blocks)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size in tokens (default: 32 on the CPU build, vLLM's choice on GPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"context limit (lowered to what the KV holds; default {local.DRIVER_MAX_MODEL_LEN})")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"engine batch limit (default {local.DRIVER_MAX_NUM_SEQS})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget per step (default {local.DRIVER_MAX_NUM_BATCHED_TOKENS})")
    p.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                   help="a vLLM engine argument for the in-process engine (repeatable; an EngineArgs field, "
                        "value JSON or text), e.g. --engine-arg kv_offloading_size=4 --engine-arg "
                        "tensor_parallel_size=2")
    p.add_argument("--policy-option", action="append", metavar="KEY=VALUE",
                   help="scheduler policy option (repeatable; see `mars policies`)")
    p.add_argument("--admission-option", action="append", metavar="KEY=VALUE",
                   help="admission controller option (repeatable), e.g. window_max=16")
    p.add_argument("--tools", choices=("simulated", "real"), default="simulated",
                   help="simulated: sleep the recorded tool time (default); real: run tool commands in a sandbox")
    p.add_argument("--cpu-tool", default=os.environ.get("CPU_TOOL"),
                   help="tool cores, e.g. 0-3 (env CPU_TOOL); real tools pin one call per core")
    p.add_argument("--cpu-gpu", default=os.environ.get("CPU_GPU"),
                   help="cores for the driver and engine, e.g. 4-7 (env CPU_GPU)")
    p.add_argument("--tool-timeout", type=float, default=d.tool_timeout_s,
                   help="real tool timeout in seconds (default %(default)s)")
    p.add_argument("--sandbox", choices=("auto", "bwrap", "landlock", "none"), default="auto",
                   help="real-tool sandbox: writes to the workspace only, reads to it and system dirs, no "
                        "network (default auto: bwrap, else Landlock)")
    p.add_argument("--tool-net-allow", action="append", type=int, default=[], metavar="PORT",
                   help="TCP port real tools may connect to (repeatable; Landlock sandbox; default: none)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the cost-model calibration (no T_ideal, so no goodput)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--record-steps", action="store_true",
                   help="in-process engine: time every engine step and write steps.jsonl in the run dir "
                        "(fit a sim profile to it with `mars profile --from-steps`)")
    p.add_argument("--out", default=None, help="output dir (default: runs/<timestamp>_...)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vllm_mars.config import rps_arg

    p = sub.add_parser("replay", help="replay a workload through the engine with one policy; writes a run dir",
                       description="Replay agent workflows (token-id prompts growing turn by turn, recorded "
                                   "output lengths, simulated or real tools) through vLLM with one policy. "
                                   "Writes run_config.json, events.jsonl, traces.jsonl, summary.json, report.md.")
    _common(p, compare=False)
    p.add_argument("--policy", default=os.environ.get("SCHEDULING_POLICY", "fcfs"),
                   help="scheduler policy, or mars (MARS admission + mars), concur (CONCUR + fcfs), "
                        "mars-no-admission (env SCHEDULING_POLICY; default fcfs)")
    p.add_argument("--rps", type=rps_arg, default=rps_arg(os.environ.get("RPS", "1.0")),
                   help="root arrivals per second (env RPS; default 1.0)")
    p.add_argument("--backend", choices=("inprocess", "http", "sim"), default="inprocess",
                   help="inprocess: vLLM in this process; http: an OpenAI-compatible server at --url (its own "
                        "scheduler policy applies; --policy then selects only the driver-side admission "
                        "controller: against `mars serve` or the sidecar, which admit on their own, use a "
                        "policy without admission such as fcfs); sim: the virtual-time engine (vLLM's scheduler "
                        "with the step times of --profile, no model; hours of agent time in seconds)")
    p.add_argument("--url", default=None, help="server URL for --backend http, e.g. http://127.0.0.1:8000")
    p.set_defaults(func=_replay)

    p = sub.add_parser("compare", help="run several policies on the same workload; prints the comparison table",
                       description="Each policy at each rps on the same workload and engine settings, one after "
                                   "another in this process. Prints the speedup of mars's mean E2E over the "
                                   "fastest baseline per rps and goodput per policy; writes compare.json and "
                                   "report.md. With no arguments: the bundled compact workload, tiny CPU model, "
                                   "48 KV blocks, 4 roots/s, mars vs mars-no-admission vs fcfs.")
    _common(p, compare=True)
    from vllm_mars.driver.compare import DEFAULT_POLICIES, DEFAULT_RPS

    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated policies (default %(default)s)")
    p.add_argument("--backend", choices=("inprocess", "sim"), default="inprocess",
                   help="inprocess: vLLM in this process (default); sim: the virtual-time engine with --profile")
    p.add_argument("--rps", default=",".join(f"{r:g}" for r in DEFAULT_RPS),
                   help="comma-separated arrival rates (default %(default)s)")
    p.set_defaults(func=_compare)

    p = sub.add_parser("report", help="recompute summary.json and report.md of a run or compare dir")
    p.add_argument("run_dir", help="a directory written by mars replay or mars compare")
    p.set_defaults(func=_report)


_SHAPE_FLAGS = ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens")


def _engine_shape(args: argparse.Namespace, backend: str, num_blocks: int | None) -> dict:
    """The engine-shape flags: the in-process engine's defaults, or for the sim only the KV pool
    (--num-blocks or --kv-scale: its profile sets the rest, and the flags may not override it)."""
    given = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
    if backend == "sim":
        if not args.profile:
            raise ValueError("--backend sim needs --profile (a step-time profile name or file)")
        given.pop("num_blocks", None)
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ValueError(f"{flags}: the sim backend takes the engine shape from --profile {args.profile} "
                             f"(only its KV pool may change: --num-blocks or --kv-scale)")
        return {"num_blocks": args.num_blocks, "kv_scale": args.kv_scale}
    if args.profile:
        raise ValueError("--profile applies to --backend sim only")
    if args.kv_scale is not None:
        raise ValueError("--kv-scale scales the sim profile's KV pool: it applies to --backend sim only")
    from vllm_mars.engine import local

    return {"num_blocks": args.num_blocks if num_blocks is None else num_blocks, "block_size": args.block_size,
            "max_model_len": given.get("max_model_len", local.DRIVER_MAX_MODEL_LEN),
            "max_num_seqs": given.get("max_num_seqs", local.DRIVER_MAX_NUM_SEQS),
            "max_num_batched_tokens": given.get("max_num_batched_tokens", local.DRIVER_MAX_NUM_BATCHED_TOKENS)}


def _config(args: argparse.Namespace, num_blocks: int | None = None, **kw):
    from vllm_mars.driver.runner import ReplayConfig
    from vllm_mars.engine.local import parse_engine_arg_items

    backend = kw.get("backend", getattr(args, "backend", "inprocess"))
    kw.setdefault("backend", backend)
    return ReplayConfig(
        workload=args.workload, num_workflows=args.num_workflows, arrival=args.arrival, seed=args.seed,
        model=args.model, profile=args.profile, **_engine_shape(args, backend, num_blocks),
        engine_args=parse_engine_arg_items(args.engine_arg), record_steps=args.record_steps,
        policy_options=_kv(args.policy_option, "--policy-option"),
        admission_options=_kv(args.admission_option, "--admission-option"), tools=args.tools,
        cpu_tool=args.cpu_tool, cpu_gpu=args.cpu_gpu, tool_timeout_s=args.tool_timeout, sandbox=args.sandbox,
        tool_net_allow=args.tool_net_allow,
        calibrate=not args.no_calibrate, progress=not args.no_progress and sys.stderr.isatty(), out=args.out,
        **kw)


def _check_engine(cfg, policies: list[str]) -> None:
    """Refuse, before anything starts, a policy the in-process engine cannot serve as configured."""
    if cfg.backend != "inprocess":
        return
    from vllm_mars.driver.control import check_policy
    from vllm_mars.engine.local import check_policy_engine, on_cpu

    for name in policies:
        check_policy_engine(check_policy(name).scheduler_policy, on_cpu(), cfg.engine_args)


def _check_workload(path: str) -> None:
    if not Path(path).exists():
        raise FileNotFoundError(f"workload {path} not found")


def _quiet_engine(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not getattr(args, "verbose", False):
        import warnings

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        warnings.filterwarnings("ignore", category=FutureWarning)


def _replay(args: argparse.Namespace) -> int:
    _quiet_engine(args)
    from vllm_mars.driver.runner import run_replay
    from vllm_mars.metrics.report import summary_table

    _check_workload(args.workload)
    cfg = _config(args, policy=args.policy, rps=args.rps, backend=args.backend, url=args.url)
    _check_engine(cfg, [args.policy])
    out, _ = run_replay(cfg)
    summary = json.loads((out / "summary.json").read_text())
    print(summary_table([(args.policy, summary)]))
    print(f"\nrun dir: {out}")
    return 0 if summary.get("errors", 0) == 0 else 1


def compare_config(args: argparse.Namespace):
    """(ReplayConfig, policies) of ``mars compare`` from its parsed arguments (also used by
    benchmark/perf/compare_default.py, so the recorded run is exactly the command's)."""
    _check_workload(args.workload)
    from vllm_mars.engine.local import COMPARE_CPU_NUM_BLOCKS, on_cpu

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    cfg = _config(args, num_blocks=COMPARE_CPU_NUM_BLOCKS if args.num_blocks is None and on_cpu() else None)
    _check_engine(cfg, policies)
    return cfg, policies


def _compare(args: argparse.Namespace) -> int:
    _quiet_engine(args)
    from vllm_mars.driver.compare import run_compare
    from vllm_mars.metrics.compare import format_table

    cfg, policies = compare_config(args)
    out, record = run_compare(cfg, policies, _floats(args.rps, "--rps"), args.out)
    print(format_table(record))
    print(f"\nT_ideal: {(record.get('cost_model') or {}).get('source', 'none')}; wall {record['wall_s']:.0f} s; "
          f"report: {out / 'report.md'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from vllm_mars.metrics.compare import format_table, write_compare_report
    from vllm_mars.metrics.events import read_events
    from vllm_mars.metrics.report import summary_table, write_run_report
    from vllm_mars.metrics.summary import summarize

    d = Path(args.run_dir)
    if (d / "compare.json").exists():
        record = json.loads((d / "compare.json").read_text())
        summaries = {}
        for c in record["cells"]:
            for p, info in c["policies"].items():
                if info.get("run_dir") and Path(info["run_dir"]).exists():
                    s = summarize(read_events(info["run_dir"]))
                    Path(info["run_dir"], "summary.json").write_text(json.dumps(s, indent=2) + "\n")
                    write_run_report(info["run_dir"], s)
                    summaries.setdefault(c["rps"], {})[p] = s
        write_compare_report(d, record, summaries)
        print(format_table(record))
        print(f"\nreport: {d / 'report.md'}")
        return 0
    summary = summarize(read_events(d))
    (d / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    path = write_run_report(d, summary)
    print(summary_table([(str(summary.get("policy")), summary)]))
    print(f"\nreport: {path}")
    return 0
