"""``mars serve``: a vLLM OpenAI server with MarsScheduler plus the admission sidecar in front, one
command: its flags, the engine's start/restart watcher, and the ``--ray`` branch (Ray Serve replicas
behind the admission gate)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from vllm_mars.commands.admission import _add_sidecar_options, _kv, _sidecar_config
from vllm_mars.config import check_engine_options
from vllm_mars.engine.local import (
    CPU_SERVE_MAX_MODEL_LEN,
    SERVER_MAX_NUM_SEQS,
    on_cpu,
    parse_engine_arg_items,
    serve_sizes,
    server_args,
)
from vllm_mars.policies import make_policy
from vllm_mars.process import kill_group, stop_group, wait_http_ok

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="vLLM's OpenAI server with MarsScheduler plus the admission sidecar in front",
        description="Start `python -m vllm.entrypoints.openai.api_server` with MarsScheduler on 127.0.0.1 "
                    "(--engine-port), wait until it is healthy, then serve the admission sidecar on "
                    "--host:--port. Clients talk to the sidecar. A vLLM server that exits later is restarted "
                    "(same port and key; back-off while it keeps dying). Ctrl-C stops both.")
    p.add_argument("model", help="model path or name (offline: a local directory)")
    p.add_argument("--host", default="127.0.0.1", help="sidecar listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="sidecar port, the one clients use (default 8000)")
    p.add_argument("--engine-port", type=int, default=None,
                   help="vLLM server port on 127.0.0.1 (default --port + 1)")
    p.add_argument("--served-model-name", default=None, help="model name clients send (default: the path)")
    p.add_argument("--policy", default="mars", help="in-engine scheduling policy (see `mars policies`; default mars)")
    p.add_argument("--policy-option", action="append", metavar="KEY=VALUE",
                   help="a policy config field for additional_config['mars']; repeatable")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (num_gpu_blocks_override); default: vLLM's sizing (GPU) / 256 MiB (CPU)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size in tokens (default: 32 on the CPU build, vLLM's choice on GPU)")

    p.add_argument("--max-model-len", type=int, default=None,
                   help="max context length (default: the model's own on GPU; on the CPU build "
                        f"{CPU_SERVE_MAX_MODEL_LEN} or less when the model or --num-blocks hold less)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"max running sequences (default: vLLM's on GPU, {SERVER_MAX_NUM_SEQS} on the CPU build)")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="engine platform for the engine defaults (cpu: bfloat16, 32-token blocks, 256 MiB KV; "
                        "gpu: vLLM's own); the scheduler follows vLLM's async-scheduling choice (default auto)")
    # -- engine arguments (issue 13) --
    p.add_argument("--engine-arg", action="append", metavar="KEY=VALUE",
                   help="a vLLM engine argument (repeatable; an EngineArgs field, value JSON or text), validated "
                        "before vLLM starts, e.g. --engine-arg tensor_parallel_size=2 --engine-arg kv_offloading_size=4")
    p.add_argument("--vllm-args", default="", metavar="'ARGS'",
                   help="extra arguments for the vLLM server, one shell-quoted string (not validated)")
    p.add_argument("--engine-timeout", type=float, default=900.0, metavar="S",
                   help="seconds to wait for the vLLM server to become healthy (default 900)")
    p.add_argument("--engine-log", metavar="PATH", help="write the vLLM server's output here (default: inherit)")
    p.add_argument("--cost-model", metavar="FILE",
                   help="the engine's cost model for the policy and the mars controller: a CostModel JSON "
                        "or a step-time profile (name or `mars profile` output). Without it the policy fits "
                        "one online from step times and the controller uses its footprint rules")
    _add_sidecar_options(p, serve=True)
    p.add_argument("--scripted", default=None, metavar="TASKS",
                   help="the scripted model: for prompts of the tasks in TASKS (mas_task_v1 JSONL with "
                        "payload.script, e.g. benchmark/tasks/coding.jsonl) the engine emits each task's "
                        "scripted solution as tool calls, so real agents do real work with the tiny model "
                        "(docs/frontends.md, the scripted model)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME|none",
                   help="vLLM tool-call parser; tool calling (tool_choice auto, which OpenCode and Codex send) "
                        "is on by default with the parser that fits the model: qwen3_coder for Qwen3-Coder, "
                        "hermes for Qwen2/Qwen3 and the tiny model, openai for gpt-oss (docs/frontends.md); "
                        "'none' leaves it off")
    # -- Ray Serve (issue 33): N replicas behind the gate, on a local or an existing Ray cluster --
    p.add_argument("--ray", action="store_true",
                   help="run the engine as --replicas Ray Serve replicas (vllm_mars.serve_ray; needs "
                        "`pip install 'vllm-mars[ray]'`) with the admission gate here and MarsRouter placing "
                        "calls; --engine-port is unused (docs/scale-out.md)")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: vLLM replicas (default 1)")
    p.add_argument("--address", default=None,
                   help="with --ray: an existing Ray cluster (`ray start --head` prints it, e.g. 10.0.0.1:6379); "
                        "default: start a local one")
    p.add_argument("--replica-cpus", type=float, default=1.0,
                   help="with --ray: Ray CPUs each replica reserves (default 1)")
    p.add_argument("--replica-gpus", type=float, default=0.0,
                   help="with --ray: GPUs each replica reserves (1 on a GPU cluster: Ray then gives each its own "
                        "device through CUDA_VISIBLE_DEVICES; default 0)")
    p.add_argument("--replica-log-dir", default=None, metavar="DIR",
                   help="with --ray: write each replica's vLLM output to DIR/replica-PORT.log")
    p.add_argument("--placement", default="mars", metavar="RULE",
                   help="with --ray: where the gate places a new root over the replicas: mars (most KV budget), "
                        "round-robin, session-hash, least-loaded (fewest requests running + waiting); a root's "
                        "later calls stay on its replica (default mars; experiments/scale_out/README.md "
                        "compares them)")
    p.set_defaults(func=_serve)


class _Engine:
    """The vLLM server behind ``mars serve``, in its own process group. Once it was healthy, a
    watcher thread restarts it (same command, port and key) whenever it exits while the sidecar
    serves: a killed or crashed engine comes back instead of leaving the sidecar answering 503
    for good. Restarts back off (1 s doubling to 30 s) while the engine dies within a minute of
    its start; ``stop`` ends the watcher and the engine's whole process group."""

    #: an engine that lived this long resets the back-off
    STABLE_S = 60.0
    MAX_BACKOFF_S = 30.0

    def __init__(self, cmd: list[str], env: dict[str, str], log: Any, url: str, timeout: float) -> None:
        import threading

        self.cmd, self.env, self.log, self.url, self.timeout = cmd, env, log, url, timeout
        self.restarts = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.proc = self._spawn()
        self._started = time.monotonic()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT if self.log else None,
                                start_new_session=True, env=self.env)

    def wait_healthy(self) -> None:
        wait_http_ok(self.url + "/health", self.proc, self.timeout, what="the vLLM server")

    def supervise(self) -> None:
        import threading

        threading.Thread(target=self._watch, name="mars-serve-engine", daemon=True).start()

    def _watch(self) -> None:
        fails = 0
        while True:
            proc = self.proc
            rc = proc.wait()
            if self._stopping.is_set():
                return
            kill_group(proc.pid, signal.SIGKILL)  # what is left of it (engine core, workers)
            fails = 0 if time.monotonic() - self._started >= self.STABLE_S else fails + 1
            delay = min(self.MAX_BACKOFF_S, 2.0 ** fails - 1.0)
            print(f"mars serve: the vLLM server exited with code {rc}; restarting it"
                  + (f" in {delay:.0f} s" if delay else ""), file=sys.stderr, flush=True)
            if self._stopping.wait(delay):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self.proc = self._spawn()
                self._started = time.monotonic()
                self.restarts += 1
            try:
                self.wait_healthy()
                print(f"mars serve: the vLLM server is back (restart {self.restarts})", file=sys.stderr, flush=True)
            except (RuntimeError, TimeoutError) as e:
                if self._stopping.is_set():
                    return
                print(f"mars serve: the restarted vLLM server failed: {e}", file=sys.stderr, flush=True)
                if self.proc.poll() is None:
                    kill_group(self.proc.pid, signal.SIGKILL)  # not healthy in time: start over

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            proc = self.proc
        stop_group(proc, timeout=30)
        kill_group(proc.pid, signal.SIGKILL)  # children that outlived the server


def _tool_calling_args(args: argparse.Namespace, cmd: list[str]) -> tuple[list[str], str | None]:
    """Tool calling on by default with the parser that fits the model (issue 12); logged.
    Returns the server arguments to add and the parser in use (the scheduler reads the next tool
    from outputs with the same one)."""
    from vllm_mars.engine.tool_calling import (
        choose_tool_parser,
        known_parsers,
        user_set_tool_calling,
        user_tool_parser,
        validate_parser,
    )

    if args.tool_call_parser is not None:
        validate_parser(args.tool_call_parser)
    if user_set_tool_calling(cmd):
        print("mars serve: tool calling as configured in --vllm-args", file=sys.stderr)
        named = user_tool_parser(cmd)
        return [], named if named in known_parsers() else None  # a plugin's parser: not read here
    choice = choose_tool_parser(args.model, args.served_model_name, args.tool_call_parser)
    state = f"on, parser {choice.parser}" if choice.parser else "off"
    print(f"mars serve: tool calling {state} ({choice.reason})", file=sys.stderr)
    return choice.server_args(), choice.parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _serve(args: argparse.Namespace) -> int:
    from vllm_mars.admission.sidecar import run_sidecar

    _check_ray_flags(args)
    check_engine_options(args.policy, _kv(args.policy_option, "--policy-option"))  # before vLLM starts
    engine_port = args.engine_port or args.port + 1
    if engine_port == args.port:
        raise ValueError(f"--engine-port {engine_port} must differ from --port")
    if args.cost_model:
        from vllm_mars.sim.profile import load_cost_model

        cost = load_cost_model(args.cost_model)  # ValueError naming the file or the bad field
        if args.controller == "mars" and "cost_model=" not in " ".join(args.controller_option or []):
            # the controller reads a serialised cost model (costmodel.py knows no profiles)
            fd, resolved = tempfile.mkstemp(prefix="mars-cost-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(cost.as_dict(), f)
            args.controller_option = [*(args.controller_option or []), f"cost_model={resolved}"]
    # the policy and its options, checked here before launching vLLM (not 20 s into its tracebacks)
    policy = make_policy(args.policy, _kv(args.policy_option, "--policy-option"))
    cfg = _sidecar_config(args, (f"http://127.0.0.1:{engine_port}",), args.host, args.port)

    cpu = on_cpu() if args.device == "auto" else args.device == "cpu"
    policy_options = _kv(args.policy_option, "--policy-option")
    if args.cost_model:
        policy_options["cost_model"] = cost.as_dict()
    sizes = serve_sizes(args.model, cpu, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        num_blocks=args.num_blocks, block_size=args.block_size)
    kw: dict[str, Any] = {"policy": args.policy, "policy_options": policy_options,
                          "block_size": args.block_size, **sizes, "cpu": cpu,
                          "engine_args": parse_engine_arg_items(args.engine_arg), "scripted": args.scripted}
    if args.num_blocks is not None:
        kw["num_blocks"] = args.num_blocks
    extra = shlex.split(args.vllm_args)
    if args.scripted:
        from vllm_mars.engine.scripted import SCRIPTED_CHAT_TEMPLATE

        extra += ["--chat-template", SCRIPTED_CHAT_TEMPLATE]
        print(f"mars serve: scripted model: prompts of the tasks in {args.scripted} get their scripted "
              "solutions (engine-side logits processor; everything else runs unchanged)", file=sys.stderr)
    tool_args, parser = _tool_calling_args(args, extra)
    if parser is not None:
        policy_options["tool_parser"] = parser  # the scheduler reads the next tool with it
        print(f"mars serve: the scheduler reads each call's next tool with parser {parser}", file=sys.stderr)
    if not any(a.startswith(("--disable-access-log-for-endpoints", "--disable-uvicorn-access-log")) for a in extra):
        # the sidecar polls /metrics every --telemetry-interval: keep those polls (and /health)
        # out of vLLM's access log, which otherwise is mostly them
        extra += ["--disable-access-log-for-endpoints", "/metrics,/health"]
    # the vLLM port answers only the sidecar: a per-start key (or --backend-api-key) in the
    # environment, checked by vLLM's own --api-key (/v1) and by BackendGuard (every other route)
    from vllm_mars.admission.backend_guard import KEY_ENV, MIDDLEWARE

    backend_key = args.backend_api_key or secrets.token_urlsafe(32)
    cfg = replace(cfg, backend_api_key=backend_key)
    extra += ["--middleware", MIDDLEWARE]
    if not any(a.startswith("--enable-prompt-tokens-details") for a in extra):
        # usage.prompt_tokens_details.cached_tokens: the sidecar reads what a root's first call found
        # cached (KV shared with other workflows; admission option shared = "unique")
        extra.append("--enable-prompt-tokens-details")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           *server_args(args.model, host="127.0.0.1", port=engine_port,
                        served_model_name=args.served_model_name, **kw),
           *extra, *tool_args]
    if args.ray:
        return _serve_ray(args, cmd[7:], {KEY_ENV: backend_key, "VLLM_API_KEY": backend_key}, cfg)
    # after every argument is checked: a refused start prints its one error line and nothing else
    print("mars serve: max_model_len " + (str(sizes["max_model_len"]) if sizes["max_model_len"] else
                                          "the model's own (vLLM's sizing)"), file=sys.stderr)
    log = open(args.engine_log, "w") if args.engine_log else None  # noqa: SIM115 (closed below)
    if policy.uses_cost and not args.cost_model:
        print(f"mars serve: no --cost-model: policy {args.policy} learns one from the engine's step times, a "
              "linear fit whose prefill knee misses a mixture-of-experts model's (docs/mars.md, the cost "
              "model); --cost-model PROFILE (a shipped profile or `mars profile` output) prices with a "
              "measured one", file=sys.stderr)
    print(f"mars serve: starting vLLM on 127.0.0.1:{engine_port} (policy {args.policy})", file=sys.stderr)
    logger.debug("vLLM command: %s", shlex.join(cmd))
    env = {**os.environ, KEY_ENV: backend_key, "VLLM_API_KEY": backend_key}
    engine = _Engine(cmd, env, log, f"http://127.0.0.1:{engine_port}", args.engine_timeout)
    # SIGTERM must run the cleanup below too (uvicorn re-raises the signal it caught once it has stopped;
    # with the default action the vLLM server was left running)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        engine.wait_healthy()
        engine.supervise()  # from now on a vLLM server that dies is restarted
        print(f"mars serve: sidecar on http://{args.host}:{args.port}/v1 (controller {args.controller})",
              file=sys.stderr)
        run_sidecar(cfg)
        return 0
    finally:
        engine.stop()
        if log is not None:
            log.close()


def _check_ray_flags(args: argparse.Namespace) -> None:
    """The --ray flags, checked before anything starts (a Ray flag without --ray is an error, not ignored)."""
    if not args.ray:
        given = [f for f, on in (("--replicas", args.replicas != 1), ("--address", args.address is not None),
                                 ("--replica-cpus", args.replica_cpus != 1.0), ("--replica-gpus", args.replica_gpus != 0),
                                 ("--replica-log-dir", args.replica_log_dir is not None),
                                 ("--placement", args.placement != "mars")) if on]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --ray (Ray Serve replicas)")
        return
    if args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: give at least 1")
    if not args.replica_cpus > 0:
        raise ValueError(f"--replica-cpus {args.replica_cpus}: must be above 0")
    if not args.replica_gpus >= 0:
        raise ValueError(f"--replica-gpus {args.replica_gpus}: must be 0 or more")


def _serve_ray(args: argparse.Namespace, engine_argv: list[str], env: dict[str, str], cfg: Any) -> int:
    """``mars serve --ray``: deploy the replicas, then serve the admission gate until interrupted."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise SystemExit("mars serve --ray: Ray Serve is not installed (pip install 'vllm-mars[ray]')") from None
    from vllm_mars import serve_ray
    from vllm_mars.admission.sidecar.serving import serve_app

    where = args.address or "a local Ray cluster"
    print(f"mars serve: deploying {args.replicas} vLLM replica(s) on {where} (policy {args.policy})",
          file=sys.stderr)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        handle = serve_ray.start(args.replicas, engine_argv, address=args.address, replica_cpus=args.replica_cpus,
                                 replica_gpus=args.replica_gpus, env=env, startup_timeout_s=args.engine_timeout, log_dir=args.replica_log_dir)
        print(f"mars serve: gate on http://{args.host}:{args.port}/v1 (controller {args.controller}, "
              f"placement {cfg.placement}, MarsRouter placing calls)", file=sys.stderr)
        serve_app(serve_ray.gate_for(handle, cfg))
        return 0
    finally:
        serve_ray.stop()
