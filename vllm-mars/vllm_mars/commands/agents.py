"""``mars agents run``: concurrent real agent-CLI sessions (Codex, OpenCode) against a server."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agents", help="run real agent CLIs (Codex, OpenCode) against a server")
    asub = p.add_subparsers(dest="agents_command", metavar="ACTION")
    r = asub.add_parser(
        "run", help="N concurrent sandboxed sessions of an agent CLI; writes a run dir like mars replay",
        description="Run each task as a real, non-interactive session of the CLI (codex exec / opencode run), "
                    "--concurrency at a time, each in its own workspace under bubblewrap (writes only there; "
                    "its only network is the server, through a per-session measuring proxy). Records every "
                    "call (E2E, TTFT, tokens, the workflow id the sidecar assigned) into events.jsonl, "
                    "traces.jsonl, summary.json and report.md. Install the CLIs first: scripts/setup_agents.sh.")
    r.add_argument("--frontend", required=True, choices=("codex", "opencode", "openhands"), help="the agent CLI")
    r.add_argument("--tasks", required=True, metavar="FILE",
                   help="mas_task_v1 JSONL, a JSON list of prompts (a nested list: one session resumed per "
                        "prompt), or a text file with one prompt per line")
    r.add_argument("--server", required=True, metavar="URL",
                   help="the server, e.g. http://127.0.0.1:8000 (mars serve's sidecar)")
    r.add_argument("--concurrency", type=int, default=1, help="sessions at once (default 1)")
    r.add_argument("--model", default=None, help="served model name (default: the server's first)")
    r.add_argument("--session-timeout", type=float, default=600.0, metavar="S",
                   help="kill a session after S seconds (default 600)")
    r.add_argument("--resume-last", action="store_true",
                   help="follow-up prompts continue the CLI's last session (codex exec resume --last, opencode "
                        "run --continue) instead of naming it by id")
    r.add_argument("--unsandboxed", action="store_true",
                   help="run the CLIs without bubblewrap (needed where bwrap is not usable; said in the events)")
    r.add_argument("--agents-prefix", default=None, metavar="DIR",
                   help="npm prefix of the CLIs (default $MARS_AGENTS_PREFIX, else ./.agents, else PATH)")
    r.add_argument("--api-key", default=os.environ.get("MARS_API_KEY"),
                   help="API key the CLIs send (default $MARS_API_KEY, else a placeholder)")
    r.add_argument("--context-window", type=int, default=32768, help="context window the CLIs assume")
    r.add_argument("--max-output-tokens", type=int, default=None,
                   help="OpenCode's output limit (its max_tokens); Codex sends none: cap it on the server")
    r.add_argument("--out", default=None, help="run dir (default runs/<timestamp>_agents-<frontend>)")
    r.set_defaults(func=_run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _run(args: argparse.Namespace) -> int:
    from vllm_mars.agents.runner import AgentRunConfig, run_agents
    from vllm_mars.metrics.report import summary_table

    cfg = AgentRunConfig(frontend=args.frontend, tasks=args.tasks, server=args.server,
                         concurrency=args.concurrency, model=args.model, session_timeout_s=args.session_timeout,
                         resume_last=args.resume_last,
                         unsandboxed=args.unsandboxed, agents_prefix=args.agents_prefix, api_key=args.api_key,
                         context_window=args.context_window, max_output_tokens=args.max_output_tokens,
                         out=args.out)
    out = run_agents(cfg)
    summary = json.loads(Path(out, "summary.json").read_text())
    print(summary_table([(f"agents-{args.frontend}", summary)]))
    print(f"\nrun dir: {out}", file=sys.stderr)
    return 0 if summary.get("errors", 0) == 0 else 1
