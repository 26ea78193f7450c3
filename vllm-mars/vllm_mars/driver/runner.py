"""``run_replay``: one policy, one workload, one run directory.

Roots arrive by the arrival process and are offered to the admission controller; admitted roots
run as one asyncio task each (children as their own tasks, sharing the root's slot). A call's
prompt is token ids that grow turn by turn (turn k = turn k-1 + its actual output + the tool
output); each call generates exactly the recorded output length (``ignore_eos``). Tools run on
the tool plane after each call. A control loop feeds the controller telemetry every
``interval_s`` and ticks it; a sampler logs ``kv_sample`` events and drives the progress bar.

Outputs (SPEC section 6): ``run_config.json``, ``events.jsonl``, ``traces.jsonl``,
``summary.json`` and ``report.md`` with plots.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_mars.admission.base import PendingRoot, Telemetry
from vllm_mars.costmodel import CostModel
from vllm_mars.driver.arrivals import ARRIVAL_PROCESSES, arrival_times
from vllm_mars.driver.control import (
    check_policy,
    finish_root,
    make_controller,
    report_root_cached,
    update_root_progress,
)
from vllm_mars.driver.tools import make_tool_plane, parse_cpu_list
from vllm_mars.engine.local import DRIVER_MAX_MODEL_LEN, DRIVER_MAX_NUM_BATCHED_TOKENS, DRIVER_MAX_NUM_SEQS
from vllm_mars.metrics.events import EventLog
from vllm_mars.metrics.ideal import ideal_time

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
BACKENDS = ("inprocess", "http", "sim")
#: kv_sample periods: real engines, and the sim (hours of virtual time; 1 s keeps the log small)
SAMPLE_INTERVAL_S = 0.1
CALL_TIMEOUT_S = 600.0
SIM_SAMPLE_INTERVAL_S = 1.0
#: the long solo prompt of the sim's calibration (tokens)
SIM_CALIBRATE_PROMPT = 8192
#: The sim's largest KV pool (blocks). The pool is bookkeeping only, one small Python object per block
#: (~140 B: 10x the H200 profile's 45k blocks adds ~55 MB and ~0.7 s of start-up), so this cap only
#: keeps a typo from eating the machine's memory (5M blocks ~ 0.7 GB).
SIM_MAX_KV_BLOCKS = 5_000_000
#: The bundled compact workload (``mars compare`` with no arguments runs it).
DEFAULT_WORKLOAD = REPO_ROOT / "benchmark" / "workloads" / "compact.jsonl"


@dataclass
class ReplayConfig:
    """Everything one replay run needs; written to ``run_config.json``."""

    #: schema-v1 JSONL workload
    workload: str = str(DEFAULT_WORKLOAD)
    #: driver policy: a scheduler policy name, or mars / concur / mars-no-admission
    policy: str = "fcfs"
    #: root arrivals per second (fixed and poisson processes)
    rps: float = 1.0
    #: fixed (i/rps), poisson (rate rps) or trace (the workload's arrival_s)
    arrival: str = "fixed"
    #: roots to run (None: every workflow in the file once; more than the file cycles it, each repeat
    #: a new session of the same shape: see ``cycle_workflows``)
    num_workflows: int | None = None
    #: seed for token ids and Poisson arrivals
    seed: int = 0
    #: inprocess (vLLM LLMEngine in this process), http (an OpenAI-compatible server) or sim (the
    #: virtual-time engine: vLLM's scheduler with a step-time profile instead of a model)
    backend: str = "inprocess"
    #: step-time profile of the sim backend (shipped name or file); it sets the engine shape
    #: (KV blocks, block size, max_model_len, max_num_seqs, max_num_batched_tokens)
    profile: str | None = None
    #: server URL for the http backend
    url: str | None = None
    #: model dir (None: the tiny CPU model); for http the served model name (None: the first listed)
    model: str | None = None
    #: KV blocks of the in-process engine: None = engine.local's default (a small pool on the CPU
    #: build, so the tiny model meets real KV pressure; vLLM's sizing on GPU), 0 = vLLM's sizing.
    #: In the sim: None = the profile's pool, else this pool with the profile's step times
    num_blocks: int | None = None
    #: sim only: the KV pool is kv_scale x the profile's blocks, the step times stay the profile's
    #: (e.g. 10: the no-thrash limit of a workload); num_blocks sets the pool outright instead
    kv_scale: float | None = None
    #: KV block size in tokens: None = 32 on the CPU build, vLLM's choice on GPU
    block_size: int | None = None
    #: context limit of the engine (lowered to what num_blocks * block_size holds)
    max_model_len: int = DRIVER_MAX_MODEL_LEN
    max_num_seqs: int = DRIVER_MAX_NUM_SEQS
    max_num_batched_tokens: int = DRIVER_MAX_NUM_BATCHED_TOKENS
    #: further vLLM engine arguments (validated EngineArgs fields), e.g. {"kv_offloading_size": 4}
    engine_args: dict[str, Any] = field(default_factory=dict)
    #: scheduler policy options (additional_config["mars"] fields)
    policy_options: dict[str, Any] = field(default_factory=dict)
    #: admission controller options (its config fields)
    admission_options: dict[str, Any] = field(default_factory=dict)
    #: simulated (sleep the recorded time) or real (sandboxed subprocesses)
    tools: str = "simulated"
    #: tool cores, e.g. "0-3" (real tools pin to them; simulated tools report their count)
    cpu_tool: str | None = None
    #: engine cores: the driver narrows its own affinity to them before starting the engine
    cpu_gpu: str | None = None
    tool_timeout_s: float = 300.0
    #: auto, bwrap, landlock or none
    sandbox: str = "auto"
    #: TCP ports real tools may connect to (Landlock); none by default: no network
    tool_net_allow: list[int] = field(default_factory=list)
    #: kv_sample period in seconds of the run clock (None: 0.1 s, or 1 s of virtual time for sim,
    #: whose runs last hours of virtual time)
    sample_interval_s: float | None = None
    #: calibrate the cost model for T_ideal at start (False: no T_ideal, no goodput)
    calibrate: bool = True
    #: seconds a single LLM call may take before the workflow fails (None: 600 s on real engines, no
    #: limit in the sim, where a call queued for more than 10 virtual minutes is overload, not a hang)
    call_timeout_s: float | None = None
    #: in-process engine: time every engine step and write steps.jsonl (what `mars profile --from-steps` fits)
    record_steps: bool = False
    #: output directory (None: runs/<timestamp>_<policy>)
    out: str | None = None
    #: live progress bar on stderr
    progress: bool = True
    #: PNG plots in the run dir's report.md (an experiment grid turns them off: ~1 s of CPU a run)
    plots: bool = True

    def engine_num_blocks(self) -> int | None:
        """The in-process engine's KV blocks on this platform (None: vLLM sizes the pool)."""
        from vllm_mars.engine.local import DRIVER_CPU_NUM_BLOCKS, on_cpu, resolve_num_blocks

        return resolve_num_blocks(self.num_blocks, DRIVER_CPU_NUM_BLOCKS, on_cpu())

    def effective_max_model_len(self) -> int:
        """``max_model_len``, lowered to what ``num_blocks`` can hold (one block is vLLM's null block)."""
        if self.backend == "inprocess":
            from vllm_mars.engine.local import kv_capacity_tokens, on_cpu

            cap = kv_capacity_tokens(self.engine_num_blocks(), self.block_size, on_cpu())
            if cap is not None:
                return min(self.max_model_len, cap)
        if self.backend == "sim" and self.num_blocks:  # the profile's pool (with_profile)
            return min(self.max_model_len, (self.num_blocks - 1) * self.block_size)
        return self.max_model_len

    def validate(self) -> None:
        """Every option, before anything starts (one-line ValueErrors naming the option)."""
        from vllm_mars.config import REPLAY_RANGES
        from vllm_mars.options import check_fields

        check_fields(self, REPLAY_RANGES)
        if self.arrival not in ARRIVAL_PROCESSES:
            raise ValueError(f"arrival {self.arrival!r} unknown; allowed: {', '.join(ARRIVAL_PROCESSES)}")
        if self.arrival != "trace" and not self.rps > 0:
            raise ValueError(f"rps must be > 0, got {self.rps}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} unknown; allowed: {', '.join(BACKENDS)}")
        if self.backend == "http" and not self.url:
            raise ValueError("the http backend needs --url")
        if self.backend == "sim" and not self.profile:
            raise ValueError("the sim backend needs --profile (a step-time profile name or file)")
        if self.kv_scale is not None:
            if self.backend != "sim":
                raise ValueError("kv_scale scales the sim profile's KV pool: it needs --backend sim")
            if self.num_blocks:
                raise ValueError("num_blocks and kv_scale both size the sim's KV pool: give one of them")
        if self.backend == "sim":
            self.sim_num_blocks()
        if self.record_steps and self.backend != "inprocess":
            raise ValueError("--record-steps times the in-process engine's steps: it needs --backend inprocess")
        if self.backend == "sim" and self.tools != "simulated":
            raise ValueError("the sim backend runs in virtual time: --tools must be simulated")
        if self.num_workflows is not None and self.num_workflows < 1:
            raise ValueError(f"num_workflows must be >= 1, got {self.num_workflows}")
        if self.tools not in ("simulated", "real"):
            raise ValueError(f"tools {self.tools!r} unknown; allowed: simulated, real")
        if self.engine_args and self.backend != "inprocess":
            raise ValueError("engine arguments configure the in-process engine; with --backend http pass them to "
                             "the server (mars serve --engine-arg ...); the sim takes its engine from --profile")
        if self.sample_interval_s is not None and not self.sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")
        from vllm_mars.config import check_engine_options
        from vllm_mars.driver.tools import SANDBOX_MODES

        if self.sandbox not in SANDBOX_MODES:
            raise ValueError(f"sandbox {self.sandbox!r} unknown; allowed: {', '.join(SANDBOX_MODES)}")
        p = check_policy(self.policy)
        if self.backend == "inprocess":
            check_engine_options(p.scheduler_policy, self.policy_options)
        make_controller(p.controller, self.admission_options)

    def call_timeout(self) -> float | None:
        if self.call_timeout_s is not None:
            return self.call_timeout_s
        return None if self.backend == "sim" else CALL_TIMEOUT_S

    def sample_interval(self) -> float:
        if self.sample_interval_s is not None:
            return self.sample_interval_s
        return SIM_SAMPLE_INTERVAL_S if self.backend == "sim" else SAMPLE_INTERVAL_S

    def sim_num_blocks(self) -> int:
        """The sim's KV pool in blocks: ``num_blocks`` if given, else ``kv_scale`` (default 1) x the
        profile's; a pool the options set must be 2..SIM_MAX_KV_BLOCKS (one-line ValueError)."""
        from vllm_mars.sim.engine import get_profile

        p = get_profile(self.profile)
        base = p.num_kv_blocks()
        if self.num_blocks:
            n, what = self.num_blocks, f"num_blocks {self.num_blocks}"
        elif self.kv_scale is not None:
            n = int(base * self.kv_scale)
            what = f"kv_scale {self.kv_scale:g} ({n} blocks)"
        else:
            return base
        if not 2 <= n <= SIM_MAX_KV_BLOCKS:
            raise ValueError(f"{what}: the sim's KV pool must be 2..{SIM_MAX_KV_BLOCKS} blocks (profile {p.name}: "
                             f"{base} blocks, so kv_scale {2 / base:.3g}..{SIM_MAX_KV_BLOCKS / base:.4g})")
        return n

    def with_profile(self) -> ReplayConfig:
        """For the sim backend: this config with the engine shape of its profile (else itself); the
        pool is resolved to ``num_blocks`` (``sim_num_blocks``: kv_scale becomes a block count)."""
        if self.backend != "sim":
            return self
        from vllm_mars.sim.engine import get_profile

        p = get_profile(self.profile)
        return replace(self, num_blocks=self.sim_num_blocks(), kv_scale=None, block_size=p.block_size,
                       max_model_len=p.max_model_len,
                       max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens,
                       policy_options=dict(self.policy_options), admission_options=dict(self.admission_options))


class RunClock:
    """Seconds since the run start on ``time_fn`` (the event loop's clock: monotonic on a real loop,
    virtual in the simulator); before ``start`` it counts from construction. ``epoch`` is the wall
    time of the start, None on a virtual clock (a virtual run has no wall-clock instant)."""

    def __init__(self, time_fn: Callable[[], float] = time.monotonic, virtual: bool = False) -> None:
        self._time = time_fn
        self.virtual = virtual
        self.start()

    @classmethod
    def of_loop(cls, loop: asyncio.AbstractEventLoop) -> RunClock:
        return cls(loop.time, bool(getattr(loop, "virtual", False)))

    def start(self) -> None:
        self.t0 = self._time()
        self.epoch = None if self.virtual else time.time()

    def __call__(self) -> float:
        return self._time() - self.t0


def default_out_dir(policy: str) -> Path:
    stamp = time.strftime("%Y%m%d_%H%M%S")
    base = Path("runs") / f"{stamp}_{policy}"
    out, n = base, 1
    while out.exists():
        out = Path(f"{base}_{n:02d}")
        n += 1
    return out


def select_plans(plans: list, n: int | None) -> list:
    """The first ``n`` roots, cycling the file with ids suffixed ``~k`` on the k-th repeat. Token
    workloads are cycled before their ids are drawn (``load_plans(num_workflows=...)``: a repeat has
    its own tokens); this renames already-built plans (live tasks: a repeat has the same text)."""
    from vllm_mars.workload.materialize import cycle_roots

    def renamed(p, suffix, root, parent):
        wid = p.workflow_id + suffix
        kids = [(k, renamed(c, suffix, root, wid)) for k, c in p.children]
        return replace(p, workflow_id=wid, root_id=root, parent_id=parent, children=kids)

    return cycle_roots(plans, n, lambda p, suffix: renamed(p, suffix, p.workflow_id + suffix, None))


def check_context(plans: list, max_model_len: int) -> None:
    for root in plans:
        for p in root.walk():
            peak = getattr(p, "peak_context_tokens", None)  # token plans (compaction: not the last call)
            need = peak() if peak else p.final_prompt_tokens() + (p.turns[-1].output_tokens if p.turns else 0)
            if need > max_model_len:
                raise ValueError(f"workflow {p.workflow_id!r} reaches {need} tokens of context, above "
                                 f"max_model_len={max_model_len}; raise --max-model-len or scale the workload down")


async def calibrate(backend, vocab: int, max_model_len: int, seed: int = 12345, repeats: int = 2,
                    long_prompt: int = 512) -> CostModel:
    """Fit the T_ideal cost model from solo calls on the idle engine (unique ids: no cache hits).

    Times are read on the event loop's clock: wall time on a real engine, virtual time in the
    simulator (where the solo calls run through the same virtual engine, cheaply and exactly).
    """
    rng = random.Random(seed)
    p1, p2, n = 32, min(long_prompt, max_model_len // 2), 33
    loop_time = asyncio.get_running_loop().time

    async def solo(plen: int, out: int, i: int) -> float:
        ids = [rng.randrange(3, vocab) for _ in range(plen)]
        t = loop_time()
        await backend.generate(f"mars-calibrate-{plen}-{out}-{i}", ids, out, {})
        return loop_time() - t

    await solo(p1, 2, -1)  # warm-up
    t1 = min([await solo(p1, 1, i) for i in range(repeats)])
    t2 = min([await solo(p2, 1, i) for i in range(repeats)])
    t3 = min([await solo(p2, n, i) for i in range(repeats)])
    pm = p2 // 2  # the mid-size prefill: the prefill tokens a step's fixed cost is worth
    mid = (pm, min([await solo(pm, 1, i) for i in range(repeats)])) if p1 < pm else None
    return CostModel.from_solo_calls((p1, t1), (p2, t2), (n, t3), mid=mid,
                                     source="cost model calibrated by solo calls on the idle engine")


#: per-step timings of a run with record_steps
STEPS_FILE = "steps.jsonl"


def write_steps(path: Path, steps) -> None:
    """One JSON line per engine step: ``{"prefill": [[chunk, context], ...], "decode": [context, ...], "seconds"}``."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"prefill": pf, "decode": dc, "seconds": round(dt, 7)}) + "\n" for pf, dc, dt in steps)


def make_backend(cfg: ReplayConfig, clock: Callable[[], float], scheduler_policy: str):
    from vllm_mars.driver import backends

    if cfg.backend == "http":
        return backends.HTTPBackend(cfg.url, clock, model=cfg.model)
    if cfg.backend == "sim":
        from vllm_mars.sim.engine import SimBackend, get_profile

        return SimBackend(get_profile(cfg.profile), clock, policy=scheduler_policy, policy_options=cfg.policy_options,
                          seed=cfg.seed, max_model_len=cfg.effective_max_model_len(), num_blocks=cfg.num_blocks)
    model = cfg.model
    if model is None:
        from vllm_mars.tiny_model import build_tiny_model

        model = str(build_tiny_model())
    return backends.InProcessBackend(
        model, clock, policy=scheduler_policy, policy_options=cfg.policy_options,
        num_blocks=cfg.engine_num_blocks(), block_size=cfg.block_size, max_model_len=cfg.effective_max_model_len(),
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens, seed=cfg.seed,
        engine_args=cfg.engine_args, record_steps=cfg.record_steps)


class _Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="wf", dynamic_ncols=True, leave=True, mininterval=0.5)
        self._last = 0.0

    def done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def status(self, active: int, queued: int, kv: float | None, t: float) -> None:
        if self.bar is not None:
            now = time.monotonic()  # display throttling only: never reaches the run's records
            refresh = now - self._last >= 0.5
            if refresh:
                self._last = now
            self.bar.set_postfix_str(f"t={t:.0f}s active={active} queued={queued} "
                                     f"kv={'-' if kv is None else f'{kv:.0%}'}", refresh=refresh)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Replay:
    """One run's state (see the module docstring)."""

    def __init__(self, cfg: ReplayConfig, out: Path, backend, plans: list, arrivals: list[float],
                 clock: RunClock, cost: CostModel | None) -> None:
        self.cfg = cfg
        self.out = out
        self.backend = backend
        self.plans = {p.workflow_id: p for p in plans}
        self.order = [p.workflow_id for p in plans]
        self.arrivals = dict(zip(self.order, arrivals))
        self.clock = clock
        self.cost = cost
        self.policy = check_policy(cfg.policy)
        self.ctrl = make_controller(self.policy.controller,
                                    {**self.policy.controller_options, **cfg.admission_options})
        if cost is not None and hasattr(self.ctrl, "set_cost_model") and not getattr(self.ctrl, "cost", None):
            self.ctrl.set_cost_model(cost)
        cores = parse_cpu_list(cfg.cpu_tool)
        self.tools = make_tool_plane(cfg.tools, clock, root=out / "workspaces", cores=cores,
                                     timeout_s=cfg.tool_timeout_s, sandbox=cfg.sandbox, net_allow=cfg.tool_net_allow)
        self.events = EventLog(out / "events.jsonl", clock)
        self.traces = open(out / "traces.jsonl", "w", buffering=1)  # noqa: SIM115 - closed in run()
        self.progress = _Progress(len(plans), cfg.policy, cfg.progress)
        self.sample_interval = cfg.sample_interval()
        self.call_timeout = cfg.call_timeout()
        self.tasks: set[asyncio.Task] = set()
        self.remaining = len(plans)
        self.all_done = asyncio.Event()
        self.hit = [0, 0]  # recent cached, prompt tokens for the telemetry's prefix hit rate
        self.arrivals_actual: dict[str, float] = {}
        #: (tokenizer, LiveOptions) when the workload is mas_task_v1 (live agents), else None
        self.live: tuple | None = None

    # -- admission ----------------------------------------------------------------------------------
    def _flush_admission(self) -> None:
        for ev in self.ctrl.take_events():
            data = {k: v for k, v in ev.data.items() if k not in ("ts", "event")}
            self.events.emit(ev.event, ts=ev.ts, **data)

    def _tick(self) -> None:
        now = self.clock()
        for wid in self.ctrl.tick(now):
            self.events.emit("workflow_start", workflow=wid, root=wid,
                             admission_wait_s=round(now - self.arrivals_actual[wid], 6))
            self._spawn(self._run_root(wid))
        self._flush_admission()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    def _reading_ts(self, s: Telemetry) -> float:
        """The run-clock time of an engine reading. A backend caches its latest reading, and the one
        it holds when the run starts was taken on the clock before its restart (the calibration's
        last step: seconds later than the run's now). A reading can never be newer than now, so that
        one counts as now (the engine refreshes it within a step or an idle wait). Kept as stamped,
        the controller held it as its newest telemetry, rejected every real reading as older until
        the run clock caught up (3.5 s into the embedded default), and then measured every block
        evicted so far as one interval's rebuilds."""
        now = self.clock()
        return now if s.ts == 0.0 or s.ts > now else s.ts

    def _telemetry(self) -> Telemetry:
        s = self.backend.sample()
        ts = self.tools.stats()
        cached, prompt = self.hit
        # A tool plane without a worker count (simulated tools and no CPU_TOOL) has no CPU capacity
        # to run out of: the recorded tool times already hold any contention. Report no CPU signal
        # rather than "n tools on an unknown number of cores".
        cpu = ts.workers is not None
        # Every engine field passes through (waiting, retained blocks and preemptions were once
        # dropped here, so a controller never saw calls queued in the engine); the driver adds its
        # own clock, the hit rate of the calls it saw and the tool plane.
        return replace(s, ts=self._reading_ts(s), prefix_hit_rate=(cached / prompt) if prompt else None,
                       tools_in_flight=ts.in_flight if cpu else None, tool_workers=ts.workers,
                       tool_queue_wait_s=ts.ema_queue_wait_s if cpu else None)

    async def _arrivals(self) -> None:
        for wid in sorted(self.order, key=lambda w: self.arrivals[w]):
            delay = self.arrivals[wid] - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            plan = self.plans[wid]
            now = self.clock()
            self.arrivals_actual[wid] = now
            t_ideal = ideal_time(plan, self.cost) if self.cost else None
            self.events.emit("workflow_arrive", workflow=wid, root=wid, target_ts=round(self.arrivals[wid], 6),
                             prefill_tokens=plan.prefill_estimate, turns=plan.num_turns,
                             children=sum(1 for _ in plan.walk()) - 1,
                             t_ideal_s=None if t_ideal is None else round(t_ideal, 6))
            self.ctrl.offer(PendingRoot(wid, now, plan.prefill_estimate, {"turns": plan.num_turns}))
            self._tick()

    async def _control(self) -> None:
        while not self.all_done.is_set():
            self.ctrl.observe(self._telemetry())
            self._tick()
            try:
                await asyncio.wait_for(self.all_done.wait(), self.ctrl.interval_s)
            except TimeoutError:
                pass

    def _sample(self) -> None:
        s = self.backend.sample()
        tstats = self.tools.stats()
        engine = {k: v for k, v in s.as_dict().items() if k != "ts"}
        self.events.emit("kv_sample", engine_ts=round(self._reading_ts(s), 6), **engine, active=self.ctrl.num_active,
                         queued=self.ctrl.num_queued, tools_in_flight=tstats.in_flight)
        self.progress.status(self.ctrl.num_active, self.ctrl.num_queued, s.kv_usage, self.clock())

    async def _sampler(self) -> None:
        while not self.all_done.is_set():
            self._sample()
            try:
                await asyncio.wait_for(self.all_done.wait(), self.sample_interval)
            except TimeoutError:
                pass

    # -- workflows ----------------------------------------------------------------------------------
    async def _run_root(self, wid: str) -> None:
        plan = self.plans[wid]
        final_tokens = None
        try:
            if self.live is not None:
                from vllm_mars.driver.live import run_live

                final_tokens = await run_live(self, plan, *self.live)
            else:
                final_tokens = await self._run_workflow(plan)
            self.events.emit("workflow_done", workflow=wid, root=wid, root_done=True,
                             e2e_s=round(self.clock() - self.arrivals_actual[wid], 6))
        except Exception as e:  # noqa: BLE001 - one workflow's failure is recorded, the run goes on
            logger.warning("workflow %s failed: %r", wid, e)
            self.events.emit("workflow_error", workflow=wid, root=wid, root_done=True, error=repr(e)[:500])
        finally:
            finish_root(self.ctrl, wid, self.clock(), final_tokens)
            self.remaining -= 1
            self.progress.done()
            if self.remaining == 0:
                self.all_done.set()
            else:
                self._tick()

    async def _run_workflow(self, plan) -> int:
        """Run ``plan``'s calls, tools and children; returns its final context length in tokens."""
        wid, root = plan.workflow_id, plan.root_id
        t_start = self.clock()
        if plan.parent_id is not None:
            self.events.emit("workflow_start", workflow=wid, root=root, parent=plan.parent_id)
        prompt = list(plan.initial_ids)
        rounds: list[dict] = []
        waiting_kids: list[asyncio.Task] = []
        other_kids: list[asyncio.Task] = []
        error = None
        try:
            last = len(plan.turns) - 1
            for k, turn in enumerate(plan.turns):
                if waiting_kids:
                    await asyncio.gather(*waiting_kids)
                    waiting_kids = []
                if k:
                    if getattr(turn, "keep_tokens", None) is not None:  # schema v2 compaction: restart
                        prompt = prompt[: turn.keep_tokens] + turn.summary_ids
                    prompt += turn.appended_ids
                prev_tool = plan.turns[k - 1].tool_name if k else None
                extra = {"mars_workflow": wid, "mars_root": root, "mars_turn": k, "mars_last_step": k == last,
                         "mars_prefill_tokens": len(prompt)}
                if plan.parent_id is not None:
                    extra["mars_parent"] = plan.parent_id
                if prev_tool:
                    extra["mars_tool"] = prev_tool
                if turn.tool_name and k < last:  # replay's stand-in for parsing the output's tool call
                    extra["mars_next_tool"] = turn.tool_name
                rid = f"{wid}:t{k}"
                submit = self.clock()
                if plan.parent_id is None and k:
                    update_root_progress(self.ctrl, wid, len(prompt), submit)
                self.events.emit("call_submit", ts=submit, workflow=wid, root=root, turn=k, request_id=rid,
                                 prompt_tokens=len(prompt), max_tokens=turn.output_tokens)
                res = await asyncio.wait_for(self.backend.generate(rid, prompt, turn.output_tokens, extra),
                                             self.call_timeout)
                ttft = None if res.first_token_ts is None else res.first_token_ts - submit
                if res.first_token_ts is not None:
                    self.events.emit("call_first_token", ts=res.first_token_ts, workflow=wid, root=root, turn=k,
                                     request_id=rid, ttft_s=round(ttft, 6))
                self.events.emit("call_end", ts=res.end_ts, workflow=wid, root=root, turn=k, request_id=rid,
                                 prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens,
                                 output_tokens=len(res.output_ids), ttft_s=None if ttft is None else round(ttft, 6),
                                 latency_s=round(res.end_ts - submit, 6), finish_reason=res.finish_reason)
                if plan.parent_id is None and k == 0:
                    report_root_cached(self.ctrl, wid, res.cached_tokens)
                if res.cached_tokens is not None:
                    self.hit = [self.hit[0] * 0.9 + res.cached_tokens, self.hit[1] * 0.9 + res.prompt_tokens]
                if len(res.output_ids) != turn.output_tokens:
                    raise RuntimeError(f"{rid}: got {len(res.output_ids)} output tokens, asked for {turn.output_tokens}")
                rec: dict[str, Any] = {"turn": k, "request_id": rid, "submit_ts": submit,
                                       "first_token_ts": res.first_token_ts, "end_ts": res.end_ts, "ttft_s": ttft,
                                       "latency_s": res.end_ts - submit, "prompt_tokens": res.prompt_tokens,
                                       "cached_tokens": res.cached_tokens, "output_tokens": len(res.output_ids)}
                prompt += res.output_ids
                for after, child in plan.children:
                    if after == k:
                        task = self._spawn(self._run_workflow(child))
                        (waiting_kids if getattr(child, "parent_waits", True) else other_kids).append(task)
                if turn.tool_s > 0 or turn.tool_cmd:
                    rec["tool"] = await self._tool(plan, k, turn)
                rounds.append(rec)
            await asyncio.gather(*waiting_kids, *other_kids)
            return len(prompt)
        except Exception as e:
            error = repr(e)[:500]
            for t in waiting_kids + other_kids:
                t.cancel()
            raise
        finally:
            end = self.clock()
            trace = {"workflow": wid, "root": root, "parent": plan.parent_id, "start_ts": t_start, "end_ts": end,
                     "arrival_ts": self.arrivals_actual.get(wid), "rounds": rounds, "error": error,
                     "context_tokens": len(prompt)}
            if plan.parent_id is None:
                trace["e2e_s"] = end - self.arrivals_actual[wid]
            else:
                self.events.emit("workflow_done" if error is None else "workflow_error", workflow=wid, root=root,
                                 parent=plan.parent_id, root_done=False, **({"error": error} if error else {}))
            self.traces.write(json.dumps(trace, separators=(",", ":")) + "\n")

    async def _tool(self, plan, k: int, turn) -> dict[str, Any]:
        wid, root = plan.workflow_id, plan.root_id
        self.events.emit("tool_enqueue", workflow=wid, root=root, turn=k, tool=turn.tool_name)
        r = await self.tools.run(wid, k, turn.tool_name, turn.tool_cmd, turn.tool_s)
        self.events.emit("tool_start", ts=r.start_ts, workflow=wid, root=root, turn=k, tool=turn.tool_name,
                         core=r.core)
        self.events.emit("tool_end", ts=r.end_ts, workflow=wid, root=root, turn=k, tool=turn.tool_name,
                         rc=r.rc, timed_out=r.timed_out, wait_s=round(r.wait_s, 6),
                         duration_s=round(r.duration_s, 6), sandbox=r.sandbox)
        return {"tool": turn.tool_name, "enqueue_ts": r.enqueue_ts, "start_ts": r.start_ts, "end_ts": r.end_ts,
                "wait_s": r.wait_s, "duration_s": r.duration_s, "recorded_s": turn.tool_s, "rc": r.rc,
                "timed_out": r.timed_out, "sandbox": r.sandbox, "stdout_tail": r.stdout_tail,
                "stderr_tail": r.stderr_tail}

    async def run(self) -> None:
        self.events.emit("run_start", epoch=self.clock.epoch, policy=self.cfg.policy,
                         scheduler_policy=self.policy.scheduler_policy, controller=self.policy.controller,
                         backend=self.cfg.backend, workload=self.cfg.workload, rps=self.cfg.rps,
                         arrival=self.cfg.arrival, workflows=len(self.order), tools=self.cfg.tools,
                         sandbox=getattr(self.tools, "sandbox", None),
                         sandbox_protections=getattr(self.tools, "protections", None),
                         t_ideal_source=self.cost.source if self.cost else None,
                         cost_model=self.cost.as_dict() if self.cost else None)
        self._sample()
        workers = [asyncio.create_task(c) for c in (self._arrivals(), self._control(), self._sampler())]
        done_wait = asyncio.create_task(self.all_done.wait())
        try:
            # A worker that raises ends the run with its error (waiting on all_done alone would hang).
            pending: set[asyncio.Task] = {done_wait, *workers}
            while not self.all_done.is_set():
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in finished:
                    if t is not done_wait and t.exception() is not None:
                        raise t.exception()
            await asyncio.gather(*workers)
        finally:
            for w in (*workers, done_wait):
                w.cancel()
            for t in list(self.tasks):
                t.cancel()
            self._sample()
            self.progress.close()
            await self.tools.close()
            self.traces.close()


async def _replay(cfg: ReplayConfig, out: Path, cost: CostModel | None) -> tuple[Path, CostModel | None]:
    clock = RunClock.of_loop(asyncio.get_running_loop())
    policy = check_policy(cfg.policy)
    from vllm_mars.workload.materialize import load_plans
    from vllm_mars.workload.schema import sniff_schema

    live = None
    if sniff_schema(cfg.workload) == "mas_task_v1":
        from vllm_mars.driver.live import LiveOptions, load_live_plans

        tokenizer = _tokenizer(cfg)
        plans = select_plans(load_live_plans(cfg.workload, tokenizer), cfg.num_workflows)
        live = (tokenizer, LiveOptions())
    else:
        plans = load_plans(cfg.workload, seed=cfg.seed, max_model_len=cfg.effective_max_model_len(),
                           num_workflows=cfg.num_workflows)
    check_context(plans, cfg.effective_max_model_len())
    arrivals = arrival_times(len(plans), process=cfg.arrival, rps=cfg.rps, seed=cfg.seed,
                             trace=[p.arrival_s for p in plans])
    if cfg.cpu_gpu:
        os.sched_setaffinity(0, parse_cpu_list(cfg.cpu_gpu))
    backend = make_backend(cfg, clock, policy.scheduler_policy)
    await backend.start()
    replay = None
    try:
        if backend.vocab_size is not None and backend.vocab_size < 4096:
            raise ValueError(f"the model's vocabulary ({backend.vocab_size}) is below the workload's token ids (4096)")
        if cost is None and cfg.calibrate:
            cost = await _calibrate_apart(cfg, backend, clock, policy.scheduler_policy)
        # The sim prices rebuilds with its profile (SimBackend.cost_model), else the calibration.
        policy_cost = getattr(backend, "cost_model", None) or cost
        setter = (getattr(backend, "set_cost_model", None)
                  or getattr(getattr(backend, "scheduler", None), "set_cost_model", None))
        if policy_cost is not None and setter is not None and "cost_model" not in cfg.policy_options:
            setter(policy_cost)  # the policies price rebuilds with the engine's model
        clock.start()
        replay = Replay(cfg, out, backend, plans, arrivals, clock, cost)
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
                write_steps(out / STEPS_FILE, backend.step_times)
    return out, cost


def _tokenizer(cfg: ReplayConfig):
    """The model's tokenizer, for live-agent tasks (text in, text out)."""
    from transformers import AutoTokenizer

    model = cfg.model
    if model is None:
        from vllm_mars.tiny_model import build_tiny_model

        model = str(build_tiny_model())
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"live-agent (mas_task_v1) tasks need the model's tokenizer locally; --model {model!r}: "
                         f"{e}") from None


async def _calibrate_apart(cfg: ReplayConfig, backend: Any, clock: Any, scheduler_policy: str) -> CostModel:
    """The T_ideal calibration, leaving the run's engine as a run handed the model finds it.

    Calibrating on the run's own engine left its prompts in the prefix cache (and, in the sim, its
    calls in the policy's learned state), so the one run of a comparison that calibrated (the first)
    started from another state than the others: in the first cell of ``experiments/queue_wait.toml`` (37ca66c)
    that alone moved mars from 285.02 s to 285.52 s. The sim calibrates on an engine of its own
    (free in virtual time); the in-process engine calibrates on itself and then empties its prefix
    cache; a server behind ``--backend http`` keeps the calibration prompts in its cache."""
    if cfg.backend == "sim":
        cal = make_backend(cfg, clock, scheduler_policy)
        await cal.start()
        try:
            # Virtual time is free: the sim calibrates over longer prompts, closer to its contexts.
            return await calibrate(cal, 4096, cfg.effective_max_model_len(), long_prompt=SIM_CALIBRATE_PROMPT)
        finally:
            await cal.close()
    # Its calls are not the run: the scheduler's uncalibrated warning waits for the run's first step
    # (by then the driver has pinned what they measured; with a model of its own, it warns then).
    defer = getattr(getattr(backend, "scheduler", None), "defer_cost_warning", None)
    if defer is not None:
        defer(True)
    try:
        cost = await calibrate(backend, 4096, cfg.effective_max_model_len(), long_prompt=512)
    finally:
        if defer is not None:
            defer(False)
    reset = getattr(backend, "reset_prefix_cache", None)
    if reset is not None and not await reset():
        logger.warning("the engine's prefix cache could not be emptied after calibration: the run starts "
                       "with the calibration prompts cached")
    return cost


def run_replay(cfg: ReplayConfig, cost: CostModel | None = None) -> tuple[Path, CostModel | None]:
    """Run one replay; returns (run dir, the cost model used for T_ideal). Writes every output file."""
    from vllm_mars.metrics.events import read_events
    from vllm_mars.metrics.report import write_run_report
    from vllm_mars.metrics.summary import summarize

    cfg.validate()
    cfg = cfg.with_profile()
    check_policy(cfg.policy)
    out = Path(cfg.out) if cfg.out else default_out_dir(cfg.policy)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    if cfg.backend == "sim":
        from vllm_mars.sim.loop import run_virtual

        out, cost = run_virtual(_replay(cfg, out, cost))
    else:
        out, cost = asyncio.run(_replay(cfg, out, cost))
    summary = summarize(read_events(out))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_run_report(out, summary, plots=cfg.plots)
    return out, cost
