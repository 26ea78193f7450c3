"""``run_compare``: every policy on the same workload at each rps, one engine at a time.

``run_policies`` is the loop over the policies of one (workload, rps) cell; ``run_compare`` runs it
per rps and ``mars experiment run`` per grid cell (vllm_mars/experiments.py).
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from vllm_mars.admission.base import get_controller_class, make_controller
from vllm_mars.driver.config import ReplayConfig, RunPlan
from vllm_mars.driver.control import check_policy, resolve_policy
from vllm_mars.driver.runner import run_replay
from vllm_mars.engine.local import COMPARE_CPU_NUM_BLOCKS
from vllm_mars.metrics.compare import USAGE_FILE, compare_record, write_compare_report
from vllm_mars.metrics.ideal import CostModel

logger = logging.getLogger(__name__)

#: What ``mars compare`` runs with no arguments: the bundled compact workload on the tiny CPU model
#: with 48 KV blocks of 32 tokens at 4 roots/s (fcfs preempts and recomputes), mars against fcfs,
#: with the mars scheduler alone (no admission) beside them to separate the two halves of MARS.
DEFAULT_POLICIES = ("mars", "mars-no-admission", "fcfs")
DEFAULT_RPS = (4.0,)
DEFAULT_NUM_BLOCKS = COMPARE_CPU_NUM_BLOCKS  # CPU build only: GPUs use vLLM's sizing


def controller_fields(policy: str) -> frozenset[str]:
    """The admission options driver policy ``policy``'s controller takes (none for no admission)."""
    cfg = get_controller_class(resolve_policy(policy).controller).config_cls
    return frozenset(f.name for f in fields(cfg)) if is_dataclass(cfg) else frozenset()


def check_admission_options(options: Mapping[str, Any], policies: Sequence[str]) -> None:
    """Every shared admission option must be one that some compared policy's controller takes
    (ValueError naming the key, the policies and what their controllers take)."""
    takes = {p: controller_fields(p) for p in policies}
    known = frozenset().union(*takes.values())
    for key in options:
        if key not in known:
            raise ValueError(f"admission option {key!r}: none of the compared policies' admission controllers "
                             f"takes it ({', '.join(policies)}; they take: {sorted(known) or 'no options'})")

    for p, keys in takes.items():  # the values, for each controller they reach, before anything runs
        policy = resolve_policy(p)
        make_controller(policy.controller,
                        {**policy.controller_options, **{k: v for k, v in options.items() if k in keys}})


def policy_config(base: ReplayConfig, label: str, variant: Mapping[str, Any] | None = None, **kw: Any) -> ReplayConfig:
    """``base`` for the run labelled ``label``: the driver policy is ``variant["policy"]`` (default:
    the label itself); the variant's ``policy_options`` / ``admission_options`` update the base's,
    its ``replay`` fields (an experiment's ``[variants.LABEL.replay]``) replace the base's.
    The base's admission options reach the policies whose controller takes them (``mars compare
    --admission-option window_max=8`` caps mars and leaves fcfs, which has no admission, alone)."""
    v = dict(variant or {})
    policy = v.get("policy", label)
    takes = controller_fields(policy)
    shared = {k: val for k, val in base.admission_options.items() if k in takes}
    return replace(base, policy=policy,
                   policy_options={**base.policy_options, **v.get("policy_options", {})},
                   admission_options={**shared, **v.get("admission_options", {})}, **{**v.get("replay", {}), **kw})


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of the children it has waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _write_usage(run_dir: Path, cpu0: tuple[float, float], wall0: float, had_vllm: bool) -> None:
    own, kids = (b - a for a, b in zip(cpu0, _cpu()))
    usage = {"cpu_s": round(own + kids, 3), "children_cpu_s": round(kids, 3),
             "wall_s": round(time.monotonic() - wall0, 3),
             "imported_vllm": not had_vllm and "vllm" in sys.modules}
    (Path(run_dir) / USAGE_FILE).write_text(json.dumps(usage) + "\n")


def run_policies(base: ReplayConfig, policies: Sequence[str], rps: float, out: str | Path,
                 cost: CostModel | None = None, variants: Mapping[str, Mapping[str, Any]] | None = None,
                 resume: bool = False, on_run: Callable[[str], None] | None = None,
                 ) -> tuple[dict[str, dict], dict[str, str], CostModel | None]:
    """Each policy label at ``rps``, its run dir ``out/<label>``; returns (summary per label, run dir
    per label, the cost model). With ``resume``, a run dir that has ``summary.json`` is finished and
    is read, not re-run. ``on_run(label)`` is called before each run that executes. Each run that
    executes leaves its CPU and wall time in ``<run dir>/usage.json`` (``metrics.compare.USAGE_FILE``):
    this process's own (a worker's, in a parallel grid), over that run alone; ``imported_vllm``: the
    run was the first of its process to need vLLM and its CPU includes importing it (seconds)."""
    summaries: dict[str, dict] = {}
    dirs: dict[str, str] = {}
    for label in policies:
        run_dir = Path(out) / label
        done = run_dir / "summary.json"
        if not (resume and done.is_file()):
            if on_run:
                on_run(label)
            cfg = policy_config(base, label, (variants or {}).get(label), rps=rps, out=str(run_dir))
            had_vllm, cpu0, wall0 = "vllm" in sys.modules, _cpu(), time.monotonic()
            _, cost = run_replay(cfg, cost)
            _write_usage(run_dir, cpu0, wall0, had_vllm)
        summaries[label] = json.loads(done.read_text())
        dirs[label] = str(run_dir)
    return summaries, dirs, cost


def run_compare(base: ReplayConfig, policies: Sequence[str], rps_list: Sequence[float],
                out: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Run each (rps, policy); returns (compare dir, the compare record). T_ideal uses one cost
    model for every run, calibrated on the first engine."""
    if not policies:
        raise ValueError("no policies to compare")
    for p in policies:
        check_policy(p)
    check_admission_options(base.admission_options, policies)
    # (the base plan is resolved without them: each policy's run takes those its controller takes)
    base = replace(RunPlan.of(replace(base, admission_options={})).cfg, admission_options=base.admission_options)
    out = Path(out) if out else Path("runs") / f"compare_{time.strftime('%Y%m%d_%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    cost = None
    summaries: dict[float, dict[str, dict]] = {}
    dirs: dict[float, dict[str, str]] = {}
    t0 = time.monotonic()
    for rps in rps_list:
        summaries[rps], dirs[rps], cost = run_policies(base, policies, rps, out / f"rps{rps:g}", cost)
    record = compare_record(base.workload, summaries, dirs)
    record["config"] = {"policies": list(policies), "rps": list(rps_list), "num_workflows": base.num_workflows,
                        "num_blocks": base.num_blocks, "block_size": base.block_size, "backend": base.backend,
                        "profile": base.profile,
                        "model": base.model or (f"profile {base.profile}" if base.backend == "sim"
                                                else "tiny (vllm_mars.tiny_model)"),
                        "arrival": base.arrival,
                        "seed": base.seed, "tools": base.tools}
    record["cost_model"] = cost.as_dict() if cost else None
    record["wall_s"] = time.monotonic() - t0
    write_compare_report(out, record, summaries)
    return out, record
