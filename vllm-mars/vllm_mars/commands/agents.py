"""``mars agents run`` / ``mars agents compare``: real agent sessions (Codex, OpenCode, OpenHands)
against a server, and the same live session set once per scheduling policy."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vllm_mars.metrics.compare import format_table
from vllm_mars.metrics.report import summary_table


def _session_options(r: argparse.ArgumentParser, *, compare: bool) -> None:
    r.add_argument("--frontend", required=True, metavar="NAME[,NAME...]",
                   help="the agent frontend: codex, opencode or openhands; a comma list mixes them in one run "
                        "(session i uses the (i mod n)-th)")
    r.add_argument("--tasks", required=True, metavar="FILE",
                   help="mas_task_v1 JSONL (e.g. benchmark/tasks/coding.jsonl: tasks with checks and scripts), a "
                        "JSON list of prompts (a nested list: one session resumed per prompt), or a text file with "
                        "one prompt per line")
    if not compare:
        r.add_argument("--server", default=None, metavar="URL",
                       help="a running server, e.g. http://127.0.0.1:8000 (mars serve's sidecar); without it "
                            "mars serve --model-path is started for the run")
    r.add_argument("--model-path", default=None, metavar="MODEL",
                   help="the model mars serve serves when it is started here (no --server)")
    if not compare:
        r.add_argument("--policy", default="mars", help="the started server's scheduling policy (default mars)")
    r.add_argument("--num-blocks", type=int, default=None, help="the started server's KV blocks (small: KV pressure)")
    r.add_argument("--scripted", default=None, metavar="TASKS",
                   help="the started server plays the scripts of TASKS (mars serve --scripted; the tiny model)")
    r.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more mars serve argument for the started server (repeatable), e.g. --serve-arg=--max-num-seqs=8")
    r.add_argument("--rps", type=float, default=None,
                   help="open-loop session arrivals per second (default: all sessions at the start)")
    r.add_argument("--arrival", choices=("fixed", "poisson"), default="fixed", help="arrival process with --rps")
    r.add_argument("--max-requests", type=int, default=None, metavar="N",
                   help="sessions in all (tasks reused in order; default one per task)")
    r.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    r.add_argument("--concurrency", type=int, default=None,
                   help="sessions at once (default: all that have arrived)")
    r.add_argument("--cpu-server", default=os.environ.get("CPU_SERVER"), metavar="CPUS",
                   help="cores for the started server (taskset -c list; default $CPU_SERVER)")
    r.add_argument("--cpu-agent", default=os.environ.get("CPU_AGENT"), metavar="CPUS",
                   help="cores for the agent processes (taskset -c list; default $CPU_AGENT)")
    r.add_argument("--model", default=None, help="served model name (default: the server's first)")
    r.add_argument("--session-timeout", type=float, default=600.0, metavar="S",
                   help="kill a session after S seconds (default 600)")
    r.add_argument("--resume-last", action="store_true",
                   help="follow-up prompts continue the CLI's last session (codex exec resume --last, opencode "
                        "run --continue) instead of naming it by id")
    r.add_argument("--unsandboxed", action="store_true",
                   help="run the agents without bubblewrap (needed where bwrap is not usable; said in the events)")
    r.add_argument("--agents-prefix", default=None, metavar="DIR",
                   help="prefix of the installed frontends (default $MARS_AGENTS_PREFIX, else ./.agents, else PATH)")
    r.add_argument("--api-key", default=os.environ.get("MARS_API_KEY"),
                   help="API key the agents send (default $MARS_API_KEY, else a placeholder)")
    r.add_argument("--context-window", type=int, default=32768, help="context window the agents assume")
    r.add_argument("--max-output-tokens", type=int, default=None,
                   help="the output limit OpenCode and OpenHands send; Codex sends none (mars serve "
                        "--default-max-tokens gives those calls one)")
    r.add_argument("--out", default=None, help="run dir (default runs/<timestamp>_<label>)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agents", help="run real agent frontends (Codex, OpenCode, OpenHands) against a server")
    asub = p.add_subparsers(dest="agents_command", metavar="ACTION")
    r = asub.add_parser(
        "run", help="sandboxed sessions of real agent frontends; writes a run dir like mars replay",
        description="Run each task as a real, non-interactive session of the frontend (codex exec, opencode run, "
                    "an OpenHands SDK conversation), each in its own workspace under bubblewrap (writes only "
                    "there; its only network is the server, through a per-session measuring proxy). Sessions "
                    "arrive open-loop with --rps. Without --server, mars serve --model-path is started (pinned "
                    "with --cpu-server). Records every call (E2E, TTFT, tokens, the workflow id the sidecar "
                    "assigned) and whether each task's check passes afterwards into events.jsonl, traces.jsonl, "
                    "summary.json and report.md. Install the frontends first: scripts/setup_agents.sh.")
    _session_options(r, compare=False)
    r.set_defaults(func=_run)
    c = asub.add_parser(
        "compare", help="the same live session set once per policy; writes mars compare's run-dir format",
        description="For each policy: start mars serve --model-path with that policy, run the session set "
                    "(same tasks, frontends, arrivals), stop it. Writes OUT/rps<R>/<policy>/ run dirs and "
                    "OUT/compare.json + report.md in mars compare's format (mean/p90/p95 E2E, goodput, task "
                    "completion, preemptions, recomputed tokens).")
    c.add_argument("--policies", required=True, help="comma list of scheduling policies, e.g. mars,fcfs")
    _session_options(c, compare=True)
    c.set_defaults(func=_compare)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _config(args: argparse.Namespace, **over):
    from vllm_mars.agents.runner import AgentRunConfig

    kw = {"frontend": args.frontend, "tasks": args.tasks, "server": getattr(args, "server", None),
              "concurrency": args.concurrency, "model": args.model, "session_timeout_s": args.session_timeout,
              "resume_last": args.resume_last, "unsandboxed": args.unsandboxed, "agents_prefix": args.agents_prefix,
              "api_key": args.api_key, "context_window": args.context_window, "max_output_tokens": args.max_output_tokens,
              "out": args.out, "rps": args.rps, "arrival": args.arrival, "max_requests": args.max_requests, "seed": args.seed,
              "model_path": args.model_path, "policy": getattr(args, "policy", "mars"), "num_blocks": args.num_blocks,
              "scripted": args.scripted, "serve_args": tuple(args.serve_arg), "cpu_server": args.cpu_server,
              "cpu_agent": args.cpu_agent}
    kw.update(over)
    return AgentRunConfig(**kw)


def _run(args: argparse.Namespace) -> int:
    from vllm_mars.agents.runner import run_agents

    out = run_agents(_config(args))
    summary = json.loads(Path(out, "summary.json").read_text())
    print(summary_table([(summary.get("policy") or "agents", summary)]))
    print(f"\nrun dir: {out}", file=sys.stderr)
    return 0 if summary.get("errors", 0) == 0 else 1


def _compare(args: argparse.Namespace) -> int:
    from vllm_mars.agents.runner import compare_agents

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    out, record = compare_agents(_config(args), policies)
    print(format_table(record))
    print(f"\ncompare dir: {out}", file=sys.stderr)
    return 0
