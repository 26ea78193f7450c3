"""``mars replay``, ``mars compare`` and ``mars report``: the task driver's commands.

Their flags are built from :class:`~vllm_mars.driver.config.ReplayConfig`'s fields (help, flag,
choices and environment variable in each field's metadata; defaults from the dataclass): a flag not
given leaves the field's default, so every default is written once, in the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import typing
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vllm_mars.config import check_rps
from vllm_mars.driver.compare import DEFAULT_POLICIES, DEFAULT_RPS, run_compare
from vllm_mars.driver.config import ReplayConfig
from vllm_mars.driver.control import check_policy
from vllm_mars.driver.runner import run_replay
from vllm_mars.engine import local
from vllm_mars.metrics.compare import format_table, write_compare_report
from vllm_mars.metrics.events import read_events
from vllm_mars.metrics.report import summary_table, write_run_report
from vllm_mars.metrics.summary import summarize

#: fields each command sets itself (replay: --policy, --rps as one value; compare: lists of them)
_COMPARE_OWN = ("policy", "rps", "backend", "url")
#: engine-shape fields: the sim takes them from its profile (only the pool may change)
_SHAPE_FLAGS = ("num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens")


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
        for v in vals:
            check_rps(flag, v)
    elif any(not v > 0 or not math.isfinite(v) for v in vals):
        raise ValueError(f"{flag} {s!r}: expected positive finite numbers")
    return vals


def _scalar(tp: Any) -> type:
    """The CLI type of a field annotation (``int | None`` -> int)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    base = args[0]
    return base if base in (int, float, str, bool) else str


def _flag(f: dataclasses.Field) -> str:
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def add_config_flags(p: argparse.ArgumentParser, skip: Iterable[str] = (),
                     overrides: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """One flag per ``ReplayConfig`` field (but ``skip``), from the field's metadata; ``overrides``
    replace argparse keywords of a field's flag (e.g. a narrower ``choices``). A flag that is not
    given leaves the attribute unset (``argparse.SUPPRESS``) unless its environment variable is set."""
    hints = typing.get_type_hints(ReplayConfig)
    for f in dataclasses.fields(ReplayConfig):
        meta = f.metadata
        if f.name in skip or not meta.get("cli", True) or "help" not in meta:
            continue
        tp = hints[f.name]
        origin = typing.get_origin(tp)
        default = f.default if f.default is not dataclasses.MISSING else None
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        helptext = meta["help"]
        if tp is bool:
            kw["action"] = "store_false" if default else "store_true"
            if default:
                helptext = f"turn off: {helptext}"
        elif origin in (dict, list):
            kw["action"] = "append"
            if origin is list:
                kw["type"] = typing.get_args(tp)[0]
        else:
            kw["type"] = meta.get("parse") or _scalar(tp)
            if default is not None and "(default" not in helptext:
                helptext += f" (default {default})"
        if meta.get("choices"):
            kw["choices"] = meta["choices"]
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        elif "type" in kw and "choices" not in kw:
            kw["metavar"] = _flag(f).lstrip("-").upper().replace("-", "_")
        env = meta.get("env")
        if env:
            helptext += f"; env {env}"
            if os.environ.get(env) is not None:
                kw["default"] = kw["type"](os.environ[env])
        kw["help"] = helptext.replace("%", "%%")
        kw.update((overrides or {}).get(f.name, {}))
        p.add_argument(_flag(f), **kw)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay a workload through the engine with one policy; writes a run dir",
                       description="Replay agent workflows (token-id prompts growing turn by turn, recorded "
                                   "output lengths, simulated or real tools) through vLLM with one policy. "
                                   "Writes run_config.json, events.jsonl, traces.jsonl, summary.json, report.md.")
    add_config_flags(p)
    p.set_defaults(func=_replay)

    p = sub.add_parser("compare", help="run several policies on the same workload; prints the comparison table",
                       description="Each policy at each rps on the same workload and engine settings, one after "
                                   "another in this process. Prints the speedup of mars's mean E2E over the "
                                   "fastest baseline per rps and goodput per policy; writes compare.json and "
                                   "report.md. With no arguments: the bundled compact workload, tiny CPU model, "
                                   f"{local.COMPARE_CPU_NUM_BLOCKS} KV blocks, 4 roots/s, mars vs "
                                   "mars-no-admission vs fcfs.")
    add_config_flags(p, skip=("policy", "rps", "url"), overrides={
        "backend": {"choices": ("inprocess", "sim"),
                    "help": "inprocess: vLLM in this process (default); sim: the virtual-time engine with --profile"},
        "num_blocks": {"help": f"KV blocks of the in-process engine (default: {local.COMPARE_CPU_NUM_BLOCKS} on the "
                               "CPU build, small = KV pressure; vLLM's own sizing on GPU; 0 = vLLM's own sizing); "
                               "with --backend sim: the KV pool instead of the profile's"}})
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated policies (default %(default)s)")
    p.add_argument("--rps", dest="rps_list", default=",".join(f"{r:g}" for r in DEFAULT_RPS),
                   help="comma-separated arrival rates (default %(default)s)")
    p.set_defaults(func=_compare)

    p = sub.add_parser("report", help="recompute summary.json and report.md of a run or compare dir")
    p.add_argument("run_dir", help="a directory written by mars replay or mars compare")
    p.set_defaults(func=_report)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The ReplayConfig fields given on the command line (or by their environment variables)."""
    names = {f.name for f in dataclasses.fields(ReplayConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def _check_shape(given: Mapping[str, Any], backend: str) -> None:
    """The sim takes its engine shape from --profile (only its KV pool may change); --profile and
    --kv-scale apply to the sim only."""
    if backend == "sim":
        if not given.get("profile"):
            raise ValueError("--backend sim needs --profile (a step-time profile name or file)")
        shape = [k for k in _SHAPE_FLAGS if k != "num_blocks" and k in given]
        if shape:
            flags = ", ".join("--" + k.replace("_", "-") for k in shape)
            raise ValueError(f"{flags}: the sim backend takes the engine shape from --profile {given['profile']} "
                             f"(only its KV pool may change: --num-blocks or --kv-scale)")
        return
    if given.get("profile"):
        raise ValueError("--profile applies to --backend sim only")
    if given.get("kv_scale") is not None:
        raise ValueError("--kv-scale scales the sim profile's KV pool: it applies to --backend sim only")


def config_from_args(args: argparse.Namespace, **kw: Any) -> ReplayConfig:
    """The ReplayConfig of parsed ``mars replay`` / ``mars compare`` arguments (``kw`` overrides)."""
    given = {**_given(args), **kw}
    _check_shape(given, given.get("backend", "inprocess"))
    for name, flag in (("policy_options", "--policy-option"), ("admission_options", "--admission-option")):
        if name in given:
            given[name] = _kv(given[name], flag)
    if "engine_args" in given:
        given["engine_args"] = local.parse_engine_arg_items(given["engine_args"])
    given["progress"] = given.get("progress", True) and sys.stderr.isatty()
    return ReplayConfig(**given)


def _check_engine(cfg: ReplayConfig, policies: list[str]) -> None:
    """Refuse, before anything starts, a policy the in-process engine cannot serve as configured."""
    if cfg.backend != "inprocess":
        return
    for name in policies:
        local.check_policy_engine(check_policy(name).scheduler_policy, local.on_cpu(), cfg.engine_args)


def _check_workload(path: str) -> None:
    if not Path(path).exists():
        raise FileNotFoundError(f"workload {path} not found")


def _quiet_engine(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not getattr(args, "verbose", False):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        warnings.filterwarnings("ignore", category=FutureWarning)


def _replay(args: argparse.Namespace) -> int:
    _quiet_engine(args)

    cfg = config_from_args(args)
    _check_workload(cfg.workload)
    _check_engine(cfg, [cfg.policy])
    out, _ = run_replay(cfg)
    summary = json.loads((out / "summary.json").read_text())
    print(summary_table([(cfg.policy, summary)]))
    print(f"\nrun dir: {out}")
    return 0 if summary.get("errors", 0) == 0 else 1


def compare_config(args: argparse.Namespace) -> tuple[ReplayConfig, list[str]]:
    """(ReplayConfig, policies) of ``mars compare`` from its parsed arguments (also used by
    benchmark/perf/compare_default.py, so the recorded run is exactly the command's)."""
    kw = {}
    if getattr(args, "backend", "inprocess") == "inprocess" and "num_blocks" not in args and local.on_cpu():
        kw["num_blocks"] = local.COMPARE_CPU_NUM_BLOCKS
    cfg = config_from_args(args, **kw)
    _check_workload(cfg.workload)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    _check_engine(cfg, policies)
    return cfg, policies


def _compare(args: argparse.Namespace) -> int:
    _quiet_engine(args)

    cfg, policies = compare_config(args)
    out, record = run_compare(cfg, policies, _floats(args.rps_list, "--rps"), cfg.out)
    print(format_table(record))
    print(f"\nT_ideal: {(record.get('cost_model') or {}).get('source', 'none')}; wall {record['wall_s']:.0f} s; "
          f"report: {out / 'report.md'}")
    return 0


def _report(args: argparse.Namespace) -> int:
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
