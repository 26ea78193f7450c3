"""Where a simulated run's CPU goes: process CPU time spent inside chosen functions of the driver,
the admission tick, the full-path engine steps (vLLM's ``schedule()`` and ``update_from_output()``,
the KV work inside them: allocations, prefix lookups, frees, retention, the pool's per-block work),
request making and block hashing, output writing, and in garbage collection, during
``sim_speed.py``'s run (same flags, passed through).

    PYTHONPATH=<tree>/vllm-mars python benchmark/perf/sim_costs.py --workflows 200 [--costs-out f.json]

Each function is wrapped (outermost call counted once); a wrapper costs about a microsecond a call, so
the small, frequent ones (the block hasher: one call per decoded token) read high. The shares are of
``run_replay``'s CPU time. Functions a tree does not have are skipped, so two trees can be compared.
"""

from __future__ import annotations

import gc
import importlib
import json
import runpy
import sys
import time
from pathlib import Path

#: (module, qualified name, label); nested entries are counted inside their callers too
WRAPPED = (
    ("vllm_mars.driver.replay", "Replay._tick", "admission tick (the controller's tick, events)"),
    ("vllm_mars.driver.replay", "Replay._telemetry", "the tick's telemetry (engine reading, tool plane)"),
    ("vllm_mars.driver.replay", "Replay._sample", "kv_sample (every virtual second)"),
    ("vllm_mars.sim.engine", "SimBackend.sample", "  engine readings (inside the two above)"),
    ("vllm_mars.engine.rig", "make_request", "making requests (vLLM Request, block hashes)"),
    ("vllm_mars.engine.rig", "PrefixReusingHasher.__call__", "  block hasher (all calls: those of making requests, one per decoded token)"),
    ("vllm_mars.engine.scheduler", "MarsSchedulerMixin._mars_schedule_begun",
     "full path: schedule() (vLLM's, with the policy's end of step)"),
    ("vllm_mars.engine.scheduler", "MarsSchedulerMixin.update_from_output", "full path: update_from_output()"),
    ("vllm_mars.engine.rig", "batch_shape", "full path: the batch's shape"),
    ("vllm_mars.engine.rig", "fake_model_output", "full path: the model output"),
    ("vllm_mars.engine.rig", "step_outputs", "full path: the per-request outputs"),
    ("vllm_mars.engine.scheduler", "MarsSchedulerMixin._mars_end_step", "  the policy's end of step (all steps)"),
    ("vllm.v1.core.sched.output", "NewRequestData.from_request", "  scheduler output: NewRequestData"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._make_cached_request_data", "  scheduler output: CachedRequestData"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", "  scheduler output: block-id lists"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.__init__", "  scheduler output: SchedulerOutput"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._update_after_schedule", "  schedule(): computed tokens after"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._update_request_with_output", "  update: append token, check stop"),
    ("vllm.v1.structured_output", "StructuredOutputManager.accept_tokens", "  update: structured-output check"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._free_request", "  update: a finished request's free"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.make_stats", "  update: stats"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots", "  allocate_slots (all steps)"),
    ("vllm_mars.sim.blockpool", "SimFullAttentionManager.find_longest_cache_hit", "    prefix walks"),
    ("vllm_mars.engine.retention", "RetentionStore.hold", "    retention: hold"),
    ("vllm_mars.engine.retention", "RetentionStore.release", "    retention: release"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._get_local_prefix_cache_hit", "  prefix-cache lookups (all)"),
    ("vllm_mars.engine.scheduler", "MarsSchedulerMixin._free_blocks", "  request frees (retention, vLLM's free)"),
    ("vllm_mars.sim.blockpool", "SimBlockPool.get_new_blocks", "    the pool's new blocks (evictions)"),
    ("vllm_mars.sim.blockpool", "SimBlockPool.cache_full_blocks", "    the pool's caching of full blocks"),
    ("vllm_mars.sim.blockpool", "SimBlockPool.free_blocks", "    the pool's frees"),
    ("vllm_mars.sim.blockpool", "SimBlockPool.touch", "    the pool's touches (hits, retention)"),
    ("vllm_mars.engine.scheduler", "retain_finished", "    retaining a finished call's blocks"),
    ("vllm_mars.sim.blockpool", "SimKVCacheManager.estimate_cached_tokens", "    cached-token estimates"),
    ("vllm_mars.engine.rig", "PrefixReusingHasher._extend", "    hashing new full blocks"),
    ("vllm_mars.workload.materialize", "materialize_all", "the workload's token ids"),
    ("vllm_mars.sim.engine", "SimBackend._deliver", "delivering outputs to the driver"),
    ("vllm_mars.metrics.events", "EventLog.emit", "  event lines (inside the others)"),
    ("vllm_mars.driver.runner", "write_run_outputs", "summary, report, plots"),
)


def _owner(module: str, qual: str) -> tuple[object, str] | None:
    """The object holding ``module.qual`` and the attribute's name; None when this tree lacks it."""
    try:
        owner = importlib.import_module(module)
        *path, name = qual.split(".")
        for p in path:
            owner = getattr(owner, p)
        getattr(owner, name)
    except (ImportError, AttributeError):
        return None
    return owner, name


def main() -> None:
    argv = sys.argv[1:]
    out = None
    if "--costs-out" in argv:
        i = argv.index("--costs-out")
        out = argv[i + 1]
        del argv[i:i + 2]
    speed = runpy.run_path(str(Path(__file__).with_name("sim_speed.py")))  # its code, not its run
    timed = speed["_Timed"]()  # the timers of sim_speed.py --floor
    for module, qual, label in WRAPPED:
        found = _owner(module, qual)
        if found is not None:
            timed.wrap(*found, label)
    gcs = {"collections": 0, "full": 0, "cpu_s": 0.0}
    t0 = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            t0[0] = time.process_time()
        else:
            gcs["collections"] += 1
            gcs["full"] += info["generation"] == 2
            gcs["cpu_s"] += time.process_time() - t0[0]

    from vllm_mars.driver import runner

    run_replay = runner.run_replay
    total = [0.0]

    def timed_run(*a, **k):
        gc.callbacks.append(on_gc)
        t = time.process_time()
        try:
            return run_replay(*a, **k)
        finally:
            gc.callbacks.remove(on_gc)
            total[0] += time.process_time() - t

    runner.run_replay = timed_run
    sys.argv = [str(Path(__file__).with_name("sim_speed.py")), *argv]
    speed["main"]()
    rows = {label: {"calls": timed.calls[label], "cpu_s": round(s, 2), "share": round(s / total[0], 4)}
            for label, s in timed.cpu.items()}
    rows["garbage collection"] = {"calls": gcs["collections"], "full": gcs["full"], "cpu_s": round(gcs["cpu_s"], 2),
                                  "share": round(gcs["cpu_s"] / total[0], 4)}
    print(f"run_replay CPU s: {total[0]:.2f}")
    for label, r in rows.items():
        print(f"{r['cpu_s']:8.2f} s {100 * r['share']:5.1f} %  {r['calls']:>8} calls  {label}")
    if out:
        Path(out).write_text(json.dumps({"run_replay_cpu_s": round(total[0], 2), "args": argv, "costs": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
