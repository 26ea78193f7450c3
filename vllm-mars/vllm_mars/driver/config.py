"""What one replay run is: ``ReplayConfig`` (the request, as the CLI, an experiment file or a script
gives it, and as ``run_config.json`` records it), one small settings class per engine backend, and
``RunPlan``: the request resolved once at entry (driver policy, engine settings, context limit) and
handed down to everything that runs it.

Each ``ReplayConfig`` field carries its help text, CLI flag and environment variable in its
metadata (``_opt``): ``mars replay`` and ``mars compare`` build their flags from it
(:func:`vllm_mars.commands.driver.add_config_flags`), so a default is written once, here.
"""

# _opt returns dataclasses.field(...) with the flag metadata; ruff cannot see that it is field()
# ruff: noqa: RUF009
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from vllm_mars.admission.base import ControllerBase, make_controller
from vllm_mars.admission.placement import PLACEMENT_RULES, check_placement
from vllm_mars.config import REPLAY_RANGES, check_engine_options, rps_arg
from vllm_mars.costmodel import CostModel
from vllm_mars.driver.arrivals import ARRIVAL_PROCESSES
from vllm_mars.driver.backends import HTTPBackend, InProcessBackend
from vllm_mars.driver.control import DriverPolicy, check_policy
from vllm_mars.driver.tools import SANDBOX_MODES
from vllm_mars.engine import local
from vllm_mars.options import check_fields
from vllm_mars.sim.cluster import SimCluster
from vllm_mars.sim.engine import SimBackend, get_profile
from vllm_mars.sim.step_trace import StepTrace
from vllm_mars.tiny_model import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[3]
#: The bundled compact workload (``mars compare`` with no arguments runs it).
DEFAULT_WORKLOAD = REPO_ROOT / "benchmark" / "workloads" / "compact.jsonl"
#: The most replicas a sim cluster runs (``--replicas``): a typo's guard, not a limit of the design.
SIM_MAX_REPLICAS = 1024
#: The sim's largest KV pool (blocks). The pool is bookkeeping only, one small Python object per block
#: (~140 B: 10x the H200 profile's 45k blocks adds ~55 MB and ~0.7 s of start-up), so this cap only
#: keeps a typo from eating the machine's memory (5M blocks ~ 0.7 GB).
SIM_MAX_KV_BLOCKS = 5_000_000


def _opt(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None, env: str | None = None,
         choices: tuple[str, ...] | None = None, factory: Callable[[], Any] | None = None,
         metavar: str | None = None, parse: Callable[[str], Any] | None = None, cli: bool = True) -> Any:
    """A ``ReplayConfig`` field with its CLI description (``help``; ``flag``, default ``--field-name``,
    ``--no-field-name`` for a bool that defaults to True; ``env``: the environment variable that
    overrides the default on the command line; ``parse``: the flag's argparse ``type`` when the
    annotation's is not enough)."""
    meta = {"help": help, "flag": flag, "env": env, "choices": choices, "metavar": metavar, "parse": parse,
            "cli": cli}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ReplayConfig:
    """Everything one replay run needs; written to ``run_config.json``."""

    workload: str = _opt(str(DEFAULT_WORKLOAD),
                         help="schema-v1 JSONL workload, or mas_task_v1 live-agent tasks (default: the bundled "
                              "benchmark/workloads/compact.jsonl)")
    policy: str = _opt("fcfs", env="SCHEDULING_POLICY",
                       help="scheduler policy, or mars (MARS admission + mars), concur (CONCUR + fcfs), "
                            "mars-no-admission (see `mars policies`)")
    rps: float = _opt(1.0, env="RPS", parse=rps_arg, help="root arrivals per second (fixed and poisson arrivals)")
    arrival: str = _opt("fixed", choices=ARRIVAL_PROCESSES,
                        help="arrival process: fixed i/rps, poisson at rate rps, or the workload's arrival_s")
    num_workflows: int | None = _opt(None, help="root workflows to run (default: all in the file; more cycles "
                                                "the file, each repeat with its own task and turn tokens)")
    seed: int = _opt(0, help="token-id and Poisson seed")
    backend: str = _opt("inprocess", choices=("inprocess", "http", "sim"),
                        help="inprocess: vLLM in this process; http: an OpenAI-compatible server at --url (its "
                             "own scheduler policy applies; --policy then selects only the driver-side admission "
                             "controller: against `mars serve` or the sidecar, which admit on their own, use a "
                             "policy without admission such as fcfs); sim: the virtual-time engine (vLLM's "
                             "scheduler with the step times of --profile, no model; hours of agent time in seconds)")
    profile: str | None = _opt(None, help="step-time profile for --backend sim (shipped name, e.g. "
                                          "h200-qwen3-coder-30b-a3b, or a profile file); it sets the KV pool and "
                                          "the engine limits (block size, context, batch)")
    step_trace: str | None = _opt(None, help="--backend sim: charge step i the time step i took in a recorded real run "
                                             "(its steps.jsonl from --record-steps, same workload and engine shape) "
                                             "instead of the profile's, and take each call in before the step the "
                                             "real engine took it in before: the sim then reproduces that run unless "
                                             "its mechanism differs (run_end reports the first batch that differed)")
    replicas: int | None = _opt(None, help="--backend sim: N simulated engines (each with --profile's KV pool and step "
                                           "times) behind the sidecar's placement, each with its own admission "
                                           "controller (a root is placed when it arrives, then admitted by its "
                                           "replica's), on one virtual clock (default: one engine, no placement)")
    placement: str = _opt("mars", choices=PLACEMENT_RULES,
                          help="with --replicas: where a new root goes: mars (most KV budget + cached prefix), "
                               "round-robin, session-hash, least-loaded (fewest requests in the engine); a root's "
                               "turns and children stay on its replica")
    url: str | None = _opt(None, help="server URL for --backend http, e.g. http://127.0.0.1:8000")
    model: str | None = _opt(None, help="model dir (default: the tiny CPU model); for --backend http the served "
                                        "model name (default: the server's first)")
    num_blocks: int | None = _opt(None, help="KV blocks of the in-process engine (default: a small pool on the "
                                             "CPU build, so the tiny model meets KV pressure; vLLM's own sizing "
                                             "on GPU; 0 = vLLM's own sizing); with --backend sim: the KV pool "
                                             "instead of the profile's, with the profile's step times")
    kv_scale: float | None = _opt(None, help="--backend sim: the KV pool = this x the profile's blocks, step "
                                             "times unchanged (e.g. 10 for the no-thrash limit of a workload; at "
                                             f"most {SIM_MAX_KV_BLOCKS:,} blocks)")
    block_size: int | None = _opt(None, help="KV block size in tokens (default: 32 on the CPU build, vLLM's "
                                             "choice on GPU)")
    max_model_len: int = _opt(local.DRIVER_MAX_MODEL_LEN,
                              help="context limit of the engine (lowered to what the KV pool holds)")
    max_num_seqs: int = _opt(local.DRIVER_MAX_NUM_SEQS, help="engine batch limit")
    max_num_batched_tokens: int = _opt(local.DRIVER_MAX_NUM_BATCHED_TOKENS, help="token budget per step")
    engine_args: dict[str, Any] = _opt(factory=dict, flag="--engine-arg", metavar="KEY=VALUE",
                                       help="a vLLM engine argument for the in-process engine (repeatable; an "
                                            "EngineArgs field, value JSON or text), e.g. --engine-arg "
                                            "kv_offloading_size=4 --engine-arg tensor_parallel_size=2")
    policy_options: dict[str, Any] = _opt(factory=dict, flag="--policy-option", metavar="KEY=VALUE",
                                          help="scheduler policy option (repeatable; see `mars policies`)")
    admission_options: dict[str, Any] = _opt(factory=dict, flag="--admission-option", metavar="KEY=VALUE",
                                             help="admission controller option (repeatable), e.g. window_max=16")
    tools: str = _opt("simulated", choices=("simulated", "real"),
                      help="simulated: sleep the recorded tool time; real: run tool commands in a sandbox")
    cpu_tool: str | None = _opt(None, env="CPU_TOOL",
                                help="tool cores, e.g. 0-3; real tools pin one call per core, simulated tools "
                                     "report their count")
    cpu_gpu: str | None = _opt(None, env="CPU_GPU", help="cores for the driver and engine, e.g. 4-7 (the driver "
                                                         "narrows its own affinity to them before the engine "
                                                         "starts)")
    tool_timeout_s: float = _opt(300.0, flag="--tool-timeout", help="real tool timeout in seconds")
    sandbox: str = _opt("auto", choices=SANDBOX_MODES,
                        help="real-tool sandbox: writes to the workspace only, reads to it and system dirs, no "
                             "network (auto: bwrap, else Landlock)")
    tool_net_allow: list[int] = _opt(factory=list, metavar="PORT",
                                     help="TCP port real tools may connect to (repeatable; Landlock sandbox; "
                                          "default: none, no network)")
    sample_interval_s: float | None = _opt(None, flag="--sample-interval",
                                           help="kv_sample period in seconds of the run clock (default: 0.1 s; "
                                                "the sim 1 s of virtual time, its runs last hours)")
    calibrate: bool = _opt(True, help="calibrate the cost model for T_ideal at start (off: no T_ideal, no "
                                      "goodput)")
    call_timeout_s: float | None = _opt(None, flag="--call-timeout",
                                        help="seconds a single LLM call may take before the workflow fails "
                                             "(default: 600 s on real engines; no limit in the sim, where a call "
                                             "queued for more than 10 virtual minutes is overload, not a hang)")
    record_steps: bool = _opt(False, help="in-process engine: time every engine step and write steps.jsonl in "
                                          "the run dir, with the calls taken in before each step (fit a sim "
                                          "profile to it with `mars profile --from-steps`, replay it with "
                                          "--step-trace)")
    out: str | None = _opt(None, help="output dir (default: runs/<timestamp>_...)")
    progress: bool = _opt(True, help="live progress bar on stderr (when it is a terminal)")
    plots: bool = _opt(True, help="PNG plots in the run dir's report.md (~1 s of CPU a run; an experiment "
                                  "grid turns them off)")

    def validate(self) -> None:
        """Every option, before anything starts (one-line ValueErrors naming the option)."""
        RunPlan.of(self)

    def with_profile(self) -> ReplayConfig:
        """This config with the engine shape its backend resolves (the sim: its profile's, the pool
        as ``num_blocks``); what ``run_config.json`` records."""
        return RunPlan.of(self).cfg

    def engine_num_blocks(self) -> int | None:
        """The in-process engine's KV blocks on this platform (None: vLLM sizes the pool)."""
        return local.resolve_num_blocks(self.num_blocks, local.DRIVER_CPU_NUM_BLOCKS, local.on_cpu())

    def effective_max_model_len(self) -> int:
        """``max_model_len``, lowered to what the backend's KV pool holds."""
        return ENGINES[self.backend].of(self).max_model_len


def _only(cfg: ReplayConfig, backend: str, given: bool, message: str) -> None:
    if given and cfg.backend != backend:
        raise ValueError(message)


def _no_cluster(cfg: ReplayConfig) -> None:
    _only(cfg, "sim", cfg.replicas is not None,
          "replicas runs N simulated engines: it needs --backend sim (servers: mars sidecar --backend URL "
          "--backend URL ... places roots over them)")
    _only(cfg, "sim", cfg.placement != "mars",
          "placement chooses among the sim's --replicas: it needs --backend sim --replicas N (servers: mars "
          "sidecar --placement)")


# -- one settings class per backend ----------------------------------------------------------------
@dataclass(frozen=True)
class InProcessEngine:
    """vLLM's ``LLMEngine`` in this process (the tiny CPU model unless ``model``)."""

    name: ClassVar[str] = "inprocess"
    #: kv_sample period and call timeout (s) unless the config sets them
    sample_interval_s: ClassVar[float] = 0.1
    call_timeout_s: ClassVar[float | None] = 600.0

    model: str | None
    #: the pool on this platform (None: vLLM sizes it)
    num_blocks: int | None
    block_size: int | None
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    engine_args: dict[str, Any]
    record_steps: bool

    @classmethod
    def of(cls, cfg: ReplayConfig) -> InProcessEngine:
        _only(cfg, "sim", cfg.kv_scale is not None,
              "kv_scale scales the sim profile's KV pool: it needs --backend sim")
        _only(cfg, "sim", cfg.step_trace is not None,
              "step_trace replays recorded step times in the sim: it needs --backend sim")
        _no_cluster(cfg)
        blocks = cfg.engine_num_blocks()
        cap = local.kv_capacity_tokens(blocks, cfg.block_size, local.on_cpu())
        return cls(cfg.model, blocks, cfg.block_size,
                   cfg.max_model_len if cap is None else min(cfg.max_model_len, cap), cfg.max_num_seqs,
                   cfg.max_num_batched_tokens, cfg.engine_args, cfg.record_steps)

    def shaped(self, cfg: ReplayConfig) -> ReplayConfig:
        return cfg

    def check_policy(self, policy: DriverPolicy, policy_options: dict[str, Any]) -> None:
        check_engine_options(policy.scheduler_policy, policy_options)

    def make(self, clock: Callable[[], float], policy: str, policy_options: dict[str, Any], seed: int) -> Any:
        model = self.model
        if model is None:
            model = str(build_tiny_model())
        return InProcessBackend(
            model, clock, policy=policy, policy_options=policy_options, num_blocks=self.num_blocks,
            block_size=self.block_size, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, seed=seed, engine_args=self.engine_args,
            record_steps=self.record_steps)


@dataclass(frozen=True)
class HTTPEngine:
    """An OpenAI-compatible server at ``url`` (its own scheduler policy and engine shape)."""

    name: ClassVar[str] = "http"
    sample_interval_s: ClassVar[float] = 0.1
    call_timeout_s: ClassVar[float | None] = 600.0

    url: str
    model: str | None
    max_model_len: int

    @classmethod
    def of(cls, cfg: ReplayConfig) -> HTTPEngine:
        if not cfg.url:
            raise ValueError("the http backend needs --url")
        _only(cfg, "sim", cfg.kv_scale is not None,
              "kv_scale scales the sim profile's KV pool: it needs --backend sim")
        _only(cfg, "sim", cfg.step_trace is not None,
              "step_trace replays recorded step times in the sim: it needs --backend sim")
        _no_cluster(cfg)
        _only(cfg, "inprocess", cfg.record_steps,
              "--record-steps times the in-process engine's steps: it needs --backend inprocess")
        _only(cfg, "inprocess", bool(cfg.engine_args),
              "engine arguments configure the in-process engine; with --backend http pass them to the server "
              "(mars serve --engine-arg ...); the sim takes its engine from --profile")
        return cls(cfg.url, cfg.model, cfg.max_model_len)

    def shaped(self, cfg: ReplayConfig) -> ReplayConfig:
        return cfg

    def check_policy(self, policy: DriverPolicy, policy_options: dict[str, Any]) -> None:
        """The server's scheduler policy is its own."""

    def make(self, clock: Callable[[], float], policy: str, policy_options: dict[str, Any], seed: int) -> Any:
        return HTTPBackend(self.url, clock, model=self.model)


@dataclass(frozen=True)
class SimEngine:
    """The virtual-time engine: vLLM's scheduler with the step times of ``profile``."""

    name: ClassVar[str] = "sim"
    #: its runs last hours of virtual time: 1 s keeps the log small
    sample_interval_s: ClassVar[float] = 1.0
    #: no limit: a call queued for more than 10 virtual minutes is overload, not a hang
    call_timeout_s: ClassVar[float | None] = None
    #: the long solo prompt of its calibration (tokens; virtual time is free)
    calibrate_prompt: ClassVar[int] = 8192

    #: the loaded step-time profile (``vllm_mars.sim.profile.Profile``)
    profile: Any
    #: the KV pool (blocks): ``num_blocks``, else ``kv_scale`` (default 1) x the profile's
    num_blocks: int
    max_model_len: int
    #: engines behind the placement (None: one engine, no cluster); each has ``num_blocks``
    replicas: int | None = None
    #: the placement rule of a cluster (:data:`~vllm_mars.admission.placement.PLACEMENT_RULES`)
    placement: str = "mars"
    #: GiB of vLLM's CPU KV offload tier (``--engine-arg kv_offloading_size``; None: no tier)
    kv_offloading_size: float | None = None
    #: a recorded run's steps.jsonl whose step times replace the profile's (``vllm_mars.sim.step_trace``)
    step_trace: str | None = None

    @classmethod
    def of(cls, cfg: ReplayConfig) -> SimEngine:
        if not cfg.profile:
            raise ValueError("the sim backend needs --profile (a step-time profile name or file)")
        if cfg.kv_scale is not None and cfg.num_blocks:
            raise ValueError("num_blocks and kv_scale both size the sim's KV pool: give one of them")
        if cfg.record_steps:
            raise ValueError("--record-steps times the in-process engine's steps: it needs --backend inprocess")
        if cfg.tools != "simulated":
            raise ValueError("the sim backend runs in virtual time: --tools must be simulated")
        offload = None
        if cfg.engine_args:
            from vllm_mars.sim.offload import check_sim_engine_args

            offload = check_sim_engine_args(cfg.engine_args)
        if cfg.replicas is not None and not 1 <= cfg.replicas <= SIM_MAX_REPLICAS:
            raise ValueError(f"replicas must be 1..{SIM_MAX_REPLICAS}, got {cfg.replicas!r}")
        if cfg.replicas is None and cfg.placement != "mars":
            raise ValueError(f"placement {cfg.placement!r} places roots over replicas: give --replicas N")
        p = get_profile(cfg.profile)
        base = p.num_kv_blocks()
        if cfg.num_blocks:
            n, what = cfg.num_blocks, f"num_blocks {cfg.num_blocks}"
        elif cfg.kv_scale is not None:
            n = int(base * cfg.kv_scale)
            what = f"kv_scale {cfg.kv_scale:g} ({n} blocks)"
        else:
            n, what = base, ""
        if what and not 2 <= n <= SIM_MAX_KV_BLOCKS:
            raise ValueError(f"{what}: the sim's KV pool must be 2..{SIM_MAX_KV_BLOCKS} blocks (profile {p.name}: "
                             f"{base} blocks, so kv_scale {2 / base:.3g}..{SIM_MAX_KV_BLOCKS / base:.4g})")
        if cfg.step_trace is not None:
            if cfg.replicas is not None:
                raise ValueError("step_trace replays one recorded engine's steps: it cannot drive --replicas")
            StepTrace(p, cfg.step_trace)  # its errors name the file and line before anything starts
        return cls(p, n, min(p.max_model_len, (n - 1) * p.block_size), cfg.replicas, cfg.placement, offload,
                   cfg.step_trace)

    def shaped(self, cfg: ReplayConfig) -> ReplayConfig:
        """``cfg`` with the profile's engine shape and the pool as ``num_blocks``."""
        p = self.profile
        return replace(cfg, num_blocks=self.num_blocks, kv_scale=None, block_size=p.block_size,
                       max_model_len=p.max_model_len, max_num_seqs=p.max_num_seqs,
                       max_num_batched_tokens=p.max_num_batched_tokens,
                       policy_options=dict(cfg.policy_options), admission_options=dict(cfg.admission_options))

    def check_policy(self, policy: DriverPolicy, policy_options: dict[str, Any]) -> None:
        """The sim models a GPU engine: a policy that swaps KV needs the offload tier. The policy
        options are checked when the sim's scheduler is built."""
        tier = {} if self.kv_offloading_size is None else {"kv_offloading_size": self.kv_offloading_size}
        local.check_policy_engine(policy.scheduler_policy, False, tier)

    def make(self, clock: Callable[[], float], policy: str, policy_options: dict[str, Any], seed: int) -> Any:
        """One engine, or with ``replicas`` a :class:`~vllm_mars.sim.cluster.SimCluster` of that many."""
        def one() -> SimBackend:
            profile = self.profile if self.step_trace is None else StepTrace(self.profile, self.step_trace)
            return SimBackend(profile, clock, policy=policy, policy_options=policy_options, seed=seed,
                              max_model_len=self.max_model_len, num_blocks=self.num_blocks,
                              kv_offloading_size=self.kv_offloading_size)

        if self.replicas is None:
            return one()
        return SimCluster([one() for _ in range(self.replicas)], clock, rule=self.placement)


EngineSettings = InProcessEngine | HTTPEngine | SimEngine
#: backend name -> its settings class
ENGINES: dict[str, type[InProcessEngine | HTTPEngine | SimEngine]] = {
    e.name: e for e in (InProcessEngine, HTTPEngine, SimEngine)}
BACKENDS = tuple(ENGINES)


@dataclass(frozen=True)
class RunPlan:
    """A ``ReplayConfig`` resolved once, at entry: every check passed, the driver policy looked up,
    the engine's settings (and so the context limit) fixed. Everything below ``run_replay`` reads
    this, never the raw options again."""

    #: the request with the engine shape resolved (what ``run_config.json`` records)
    cfg: ReplayConfig
    policy: DriverPolicy
    engine: EngineSettings
    #: the admission controller's options: the driver policy's own, then the user's
    admission_options: dict[str, Any]

    @classmethod
    def of(cls, cfg: ReplayConfig) -> RunPlan:
        """Validate ``cfg`` and resolve it (one-line ValueErrors naming the option)."""
        check_fields(cfg, REPLAY_RANGES)
        if cfg.arrival not in ARRIVAL_PROCESSES:
            raise ValueError(f"arrival {cfg.arrival!r} unknown; allowed: {', '.join(ARRIVAL_PROCESSES)}")
        if cfg.arrival != "trace" and not cfg.rps > 0:
            raise ValueError(f"rps must be > 0, got {cfg.rps}")
        if cfg.backend not in ENGINES:
            raise ValueError(f"backend {cfg.backend!r} unknown; allowed: {', '.join(BACKENDS)}")
        if cfg.num_workflows is not None and cfg.num_workflows < 1:
            raise ValueError(f"num_workflows must be >= 1, got {cfg.num_workflows}")
        if cfg.tools not in ("simulated", "real"):
            raise ValueError(f"tools {cfg.tools!r} unknown; allowed: simulated, real")
        if cfg.sample_interval_s is not None and not cfg.sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be > 0, got {cfg.sample_interval_s}")
        if cfg.sandbox not in SANDBOX_MODES:
            raise ValueError(f"sandbox {cfg.sandbox!r} unknown; allowed: {', '.join(SANDBOX_MODES)}")
        check_placement(cfg.placement)
        engine = ENGINES[cfg.backend].of(cfg)
        policy = check_policy(cfg.policy)
        engine.check_policy(policy, cfg.policy_options)
        options = {**policy.controller_options, **cfg.admission_options}
        make_controller(policy.controller, options)  # its options, checked before anything starts
        return cls(engine.shaped(cfg), policy, engine, options)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def sample_interval_s(self) -> float:
        s = self.cfg.sample_interval_s
        return s if s is not None else self.engine.sample_interval_s

    @property
    def call_timeout_s(self) -> float | None:
        t = self.cfg.call_timeout_s
        return t if t is not None else self.engine.call_timeout_s

    def controller(self, cost: CostModel | None) -> ControllerBase:
        """A new admission controller for this run (priced with ``cost`` where it takes a cost model)."""
        ctrl = make_controller(self.policy.controller, self.admission_options)
        if cost is not None and hasattr(ctrl, "set_cost_model") and not getattr(ctrl, "cost", None):
            ctrl.set_cost_model(cost)
        return ctrl

    def make_backend(self, clock: Callable[[], float]) -> Any:
        """A new engine for this run (not started)."""
        return self.engine.make(clock, self.policy.scheduler_policy, self.cfg.policy_options, self.cfg.seed)

    def record(self) -> dict[str, Any]:
        """``run_config.json``."""
        return asdict(self.cfg)
