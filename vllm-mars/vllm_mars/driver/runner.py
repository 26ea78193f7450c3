"""``run_replay``: one policy, one workload, one run directory.

The request (:class:`~vllm_mars.driver.config.ReplayConfig`) is resolved once into a
:class:`~vllm_mars.driver.config.RunPlan`; the plan builds the engine, calibrates T_ideal
(:mod:`~vllm_mars.driver.calibrate`) and runs :class:`~vllm_mars.driver.replay.Replay` on the real
event loop or the simulator's virtual one.

Outputs (SPEC section 6): ``run_config.json``, ``events.jsonl``, ``traces.jsonl``,
``summary.json`` and ``report.md`` with plots (:func:`write_run_outputs`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from vllm_mars.costmodel import CostModel
from vllm_mars.driver.arrivals import arrival_times
from vllm_mars.driver.calibrate import calibrate_apart
from vllm_mars.driver.clock import RunClock
from vllm_mars.driver.config import DEFAULT_WORKLOAD, SIM_MAX_KV_BLOCKS, ReplayConfig, RunPlan, SimEngine
from vllm_mars.driver.live import LiveOptions, load_live_plans
from vllm_mars.driver.replay import Replay, check_context, select_plans
from vllm_mars.driver.tools import parse_cpu_list
from vllm_mars.metrics.events import read_events
from vllm_mars.metrics.report import write_run_report
from vllm_mars.metrics.summary import summarize
from vllm_mars.sim.loop import run_virtual
from vllm_mars.tiny_model import build_tiny_model
from vllm_mars.workload.materialize import load_plans
from vllm_mars.workload.schema import sniff_schema

__all__ = ["DEFAULT_WORKLOAD", "SIM_MAX_KV_BLOCKS", "STEPS_FILE", "Replay", "ReplayConfig", "RunClock", "RunPlan",
           "check_context", "default_out_dir", "run_replay", "select_plans", "write_run_outputs", "write_steps"]

logger = logging.getLogger(__name__)

#: per-step timings of a run with record_steps
STEPS_FILE = "steps.jsonl"


def default_out_dir(policy: str) -> Path:
    stamp = time.strftime("%Y%m%d_%H%M%S")
    base = Path("runs") / f"{stamp}_{policy}"
    out, n = base, 1
    while out.exists():
        out = Path(f"{base}_{n:02d}")
        n += 1
    return out


def write_steps(path: Path, steps, first_run_step: int = 0, ticks=(), starts=(), seen=(), outputs=(),
                clock_reads=()) -> None:
    """One JSON line per engine step: ``{"prefill": [[chunk, context], ...], "decode": [context, ...], "seconds",
    "added": [request id, ...]}`` (added: the requests the engine took in before it); the steps before
    ``first_run_step`` (the calibration's) also carry ``"calibration": true``. ``starts``
    (``InProcessBackend.step_starts``): each run step's ``"t"``, the run-clock time it started;
    ``outputs`` (``InProcessBackend.step_outputs``): its ``"t_out"``, the run-clock time its outputs were
    stamped (``seconds`` goes on past it: the snapshot, the hand-off, the next calls' intake).

    ``ticks`` (``InProcessBackend.control_ticks``): the driver's control-loop ticks. Each run step's line
    lists under ``"ticks"`` those that ran after the step before it ended and before it ended itself
    (they read the engine as the step before left it; the first run step: as the run started), each
    as ``[at, age]``: the tick's run-clock time and the age of the engine reading it read. Ticks after
    the last step are not listed (no step is left for them to change). ``sim/step_trace.py`` replays
    them.

    ``seen`` (``InProcessBackend.outputs_seen``): each run step's line lists under ``"seen"`` the calls it
    finished, each as ``[request id, run-clock time the driver saw the output]`` (later than the step's
    end by the hand-off to the driver's thread; the replay hands each output over then).

    ``clock_reads`` (``InProcessBackend.step_clock``): when the engine core entered the scheduler, where it
    reads its own clock (run clock): ``"t_sched"`` its ``schedule()`` of the step (after ``t``: the engine's
    own work before it), ``"t_update"`` its ``update_from_output()`` (before ``t_out``: the output processing
    after it), and ``"t_added"`` each ``add_request()`` of ``added``, in that order (before ``t``). The replay
    gives the sim's scheduler these readings."""
    per_line: dict[int, list[list[float]]] = {}
    for shown, now, age in ticks:
        line = max(shown, first_run_step)  # the step after the last one the reading showed
        per_line.setdefault(line, []).append([round(now, 7), round(max(age, 0.0), 7)])
    outs: dict[int, list[list]] = {}
    for i, rid, at in seen:
        outs.setdefault(i, []).append([rid, round(at, 7)])
    with open(path, "w") as f:
        for i, (pf, dc, dt, added) in enumerate(steps):
            rec = {"prefill": pf, "decode": dc, "seconds": round(dt, 7), "added": added}
            if i < first_run_step:
                rec["calibration"] = True
            else:
                if i < len(starts):
                    rec["t"] = round(starts[i], 7)
                if i < len(outputs):
                    rec["t_out"] = round(outputs[i], 7)
                if i < len(clock_reads):
                    sched, update, adds = clock_reads[i]
                    if sched is not None:
                        rec["t_sched"] = round(sched, 7)
                    if update is not None:
                        rec["t_update"] = round(update, 7)
                    if added and len(adds) == len(added) and None not in adds:
                        rec["t_added"] = [round(t, 7) for t in adds]
                if i in per_line:
                    rec["ticks"] = per_line[i]
                if i in outs:
                    rec["seen"] = outs[i]
            f.write(json.dumps(rec) + "\n")


def write_run_outputs(out: Path, plots: bool = True) -> dict[str, Any]:
    """``summary.json`` and ``report.md`` of run dir ``out`` from its ``events.jsonl``; returns the summary."""
    events = read_events(out)
    summary = summarize(events)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_run_report(out, summary, plots=plots, events=events)
    return summary


def _tokenizer(model: str | None):
    """The model's tokenizer, for live-agent tasks (text in, text out)."""
    from transformers import AutoTokenizer  # heavy (torch): only live-agent runs need it

    if model is None:
        model = str(build_tiny_model())
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"live-agent (mas_task_v1) tasks need the model's tokenizer locally; --model {model!r}: "
                         f"{e}") from None


def _load(plan: RunPlan) -> tuple[list, tuple | None]:
    """(root plans, (tokenizer, LiveOptions) for live-agent tasks else None)."""
    cfg = plan.cfg
    if sniff_schema(cfg.workload) == "mas_task_v1":
        tokenizer = _tokenizer(cfg.model)
        return select_plans(load_live_plans(cfg.workload, tokenizer), cfg.num_workflows), (tokenizer, LiveOptions())
    return load_plans(cfg.workload, seed=cfg.seed, max_model_len=plan.max_model_len,
                      num_workflows=cfg.num_workflows), None


async def _replay(plan: RunPlan, out: Path, cost: CostModel | None) -> tuple[Path, CostModel | None]:
    cfg = plan.cfg
    clock = RunClock.of_loop(asyncio.get_running_loop())
    plans, live = _load(plan)
    check_context(plans, plan.max_model_len)
    arrivals = arrival_times(len(plans), process=cfg.arrival, rps=cfg.rps, seed=cfg.seed,
                             trace=[p.arrival_s for p in plans])
    if cfg.cpu_gpu:
        os.sched_setaffinity(0, parse_cpu_list(cfg.cpu_gpu))
    backend = plan.make_backend(clock)
    await backend.start()
    recorded = getattr(backend, "recorded_arrivals", None)  # --step-trace: the recorded run's arrival times
    if recorded is not None:
        arrivals = recorded([p.workflow_id for p in plans], arrivals)
    replay = None
    try:
        if backend.vocab_size is not None and backend.vocab_size < 4096:
            raise ValueError(f"the model's vocabulary ({backend.vocab_size}) is below the workload's token ids (4096)")
        if cost is None and cfg.calibrate:
            cost = await calibrate_apart(plan, backend, clock)
        # The sim prices rebuilds with its profile (SimBackend.cost_model), else the calibration.
        policy_cost = getattr(backend, "cost_model", None) or cost
        setter = (getattr(backend, "set_cost_model", None)
                  or getattr(getattr(backend, "scheduler", None), "set_cost_model", None))
        if policy_cost is not None and setter is not None and "cost_model" not in cfg.policy_options:
            setter(policy_cost)  # the policies price rebuilds with the engine's model
        mark = getattr(backend, "mark_run_start", None)  # recorded steps: the calibration's end here
        if mark is not None:
            mark()
        clock.start()
        replay = Replay(plan, out, backend, plans, arrivals, clock, cost)
        if policy_cost is not cost and hasattr(replay.ctrl, "set_cost_model"):
            replay.ctrl.set_cost_model(policy_cost)
        replay.live = live
        await replay.run()
    finally:
        try:
            await backend.close()  # the sim backend raises here when the scheduler leaked
        finally:
            if replay is not None:
                replay.events.emit("run_end", engine=backend.engine_stats())
                replay.events.close()
            if getattr(backend, "step_times", None):
                write_steps(out / STEPS_FILE, backend.step_times, getattr(backend, "run_first_step", 0),
                            getattr(backend, "control_ticks", ()), getattr(backend, "step_starts", ()),
                            getattr(backend, "outputs_seen", ()), getattr(backend, "step_outputs", ()),
                            getattr(backend, "step_clock", ()))
    return out, cost


def run_replay(cfg: ReplayConfig | RunPlan, cost: CostModel | None = None) -> tuple[Path, CostModel | None]:
    """Run one replay; returns (run dir, the cost model used for T_ideal). Writes every output file."""
    plan = cfg if isinstance(cfg, RunPlan) else RunPlan.of(cfg)
    out = Path(plan.cfg.out) if plan.cfg.out else default_out_dir(plan.cfg.policy)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(json.dumps(plan.record(), indent=2) + "\n")
    if isinstance(plan.engine, SimEngine):
        out, cost = run_virtual(_replay(plan, out, cost))
    else:
        out, cost = asyncio.run(_replay(plan, out, cost))
    write_run_outputs(out, plots=plan.cfg.plots)
    return out, cost
