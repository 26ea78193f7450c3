"""``run_compare``: every policy on the same workload at each rps, one engine at a time."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_mars.driver.control import check_policy
from vllm_mars.driver.runner import ReplayConfig, run_replay
from vllm_mars.engine.local import COMPARE_CPU_NUM_BLOCKS

logger = logging.getLogger(__name__)

#: What ``mars compare`` runs with no arguments: the bundled compact workload on the tiny CPU model
#: with 48 KV blocks of 32 tokens at 4 roots/s (fcfs preempts and recomputes), mars against fcfs,
#: with the mars scheduler alone (no admission) beside them to separate the two halves of MARS.
DEFAULT_POLICIES = ("mars", "mars-no-admission", "fcfs")
DEFAULT_RPS = (4.0,)
DEFAULT_NUM_BLOCKS = COMPARE_CPU_NUM_BLOCKS  # CPU build only: GPUs use vLLM's sizing


def run_compare(base: ReplayConfig, policies: Sequence[str], rps_list: Sequence[float],
                out: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Run each (rps, policy); returns (compare dir, the compare record). T_ideal uses one cost
    model for every run, calibrated on the first engine."""
    from vllm_mars.metrics.compare import compare_record, write_compare_report

    if not policies:
        raise ValueError("no policies to compare")
    for p in policies:
        check_policy(p)
    base.validate()
    base = base.with_profile()
    out = Path(out) if out else Path("runs") / f"compare_{time.strftime('%Y%m%d_%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    cost = None
    summaries: dict[float, dict[str, dict]] = {}
    dirs: dict[float, dict[str, str]] = {}
    t0 = time.monotonic()
    for rps in rps_list:
        for policy in policies:
            cfg = replace(base, policy=policy, rps=rps, out=str(out / f"rps{rps:g}" / policy),
                          policy_options=dict(base.policy_options), admission_options=dict(base.admission_options))
            run_dir, cost = run_replay(cfg, cost)
            summaries.setdefault(rps, {})[policy] = json.loads((run_dir / "summary.json").read_text())
            dirs.setdefault(rps, {})[policy] = str(run_dir)
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
