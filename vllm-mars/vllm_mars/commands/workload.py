"""``mars gen-workload``, ``mars convert weka|tracelab|codex|opencode|openhands`` and ``mars workload-stats``."""

from __future__ import annotations

import argparse
import json
import os
import statistics

from vllm_mars.workload.ilr import generate, load_preset
from vllm_mars.workload.schema import load_workload, write_workload
from vllm_mars.workload.weka import iter_convert_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gen-workload", help="generate a synthetic workload (ILR-1..4, compact) as schema-v1 JSONL",
                       description="Seeded generator for the input-length regimes ILR-1..4 and other presets "
                                   "(TOML files in benchmark/workloads or $MARS_WORKLOADS_DIR). "
                                   "See docs/workloads.md for the operationalisation.")
    p.add_argument("--preset", default="ILR-1", help="preset name or TOML path (default ILR-1)")
    p.add_argument("--num-workflows", type=int, help="root workflows (default: the preset's, 400 for ILR)")
    p.add_argument("--scale", type=float, help="divide every token count by K (e.g. 32 for CPU runs)")
    p.add_argument("--seed", type=int, help="base seed (default: the preset's, 0)")
    p.add_argument("-o", "--output", required=True, help="output JSONL path")
    p.set_defaults(func=_gen)

    p = sub.add_parser("convert", help="convert agent traces to schema-v1 JSONL")
    csub = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    w = csub.add_parser("weka", help="agentic-coding session traces (kv-cache-tester JSON; sub-agents -> children)")
    w.add_argument("src", help="directory of trace_*.json files, or one file")
    w.add_argument("-o", "--output", required=True, help="output JSONL path")
    w.add_argument("--scale", type=float, default=1.0, help="divide every token count by K (default 1)")
    w.add_argument("--max-tool-s", type=float, default=300.0,
                   help="cap of a gap between calls, seconds; longer gaps are a user away (default 300)")
    w.add_argument("--limit", type=int, help="convert only the first N traces (sorted by name)")
    w.add_argument("--max-context", type=int,
                   help="the replay model's context window (tokens, after --scale): a call that would pass it "
                        "compacts first (system prompt and tools kept + a summary), as agents do at their "
                        "limit (default: no limit; the trace's own compactions are always kept)")
    w.add_argument("--summary-tokens", type=int,
                   help="summary length of a compaction forced by --max-context (default max_context/10)")
    w.set_defaults(func=_convert_weka)
    t = csub.add_parser("tracelab", help="TraceLab per-round CSV (session_id, arrival_time, round_idx, ...)")
    t.add_argument("src", help="CSV file")
    t.add_argument("-o", "--output", required=True, help="output JSONL path")
    t.add_argument("--scale", type=float, default=1.0, help="divide every token count by K (default 1)")
    t.add_argument("--unshared-prefix", action="store_true",
                   help="do not share round 0's prefix_len tokens across sessions")
    t.set_defaults(func=_convert_tracelab)

    for name, what, default in (
            ("codex", "Codex CLI rollouts (rollout-*.jsonl)", "$CODEX_HOME/sessions, else ~/.codex/sessions"),
            ("opencode", "OpenCode's session store (opencode.db, or the older storage/)",
             "$XDG_DATA_HOME/opencode, else ~/.local/share/opencode"),
            ("openhands", "OpenHands SDK conversation directories (base_state.json + events/)", None)):
        c = csub.add_parser(name, help=f"{what} -> one workflow per session, sub-agent sessions as children")
        c.add_argument("src", nargs=None if default is None else "?", default=None,
                       help="a file or directory" + (f" (default {default})" if default else
                                                     ": one conversation, or a directory of them"))
        c.add_argument("-o", "--output", required=True, help="output JSONL path")
        c.add_argument("--scale", type=float, default=1.0, help="divide every token count by K (default 1)")
        c.add_argument("--max-tool-s", type=float, default=300.0,
                       help="cap of a tool's or the user's gap, seconds (default 300)")
        c.set_defaults(func=_convert_sessions, frontend=name)

    p = sub.add_parser("workload-stats", help="validate a schema-v1 workload and print its statistics")
    p.add_argument("path", help="workload JSONL")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_stats)


def _gen(args: argparse.Namespace) -> int:
    cfg = load_preset(args.preset, num_workflows=args.num_workflows, scale=args.scale, seed=args.seed)
    n = write_workload(args.output, generate(cfg))
    print(f"wrote {n} workflows ({cfg.name}, scale {cfg.scale:g}, seed {cfg.seed}) to {args.output}")
    return 0


def _convert_weka(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.summary_tokens is not None and args.max_context is None:
        raise ValueError("--summary-tokens needs --max-context")
    counts = {"children": 0, "compactions": 0, "forced_compactions": 0, "truncated_inputs": 0}

    def counted():  # streamed: one trace in memory at a time
        for wf in iter_convert_dir(args.src, scale=args.scale, max_tool_s=args.max_tool_s, limit=args.limit,
                                   max_context=args.max_context, summary_tokens=args.summary_tokens):
            for w in wf.walk():
                counts["children"] += w is not wf
                for k in ("compactions", "forced_compactions", "truncated_inputs"):
                    counts[k] += w.meta.get(k, 0)
            yield wf

    tmp = f"{args.output}.part"
    try:
        n = write_workload(tmp, counted())
        os.replace(tmp, args.output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"wrote {n} workflows ({counts['children']} sub-agent children, {counts['compactions']} recorded "
          f"compactions, {counts['forced_compactions']} forced by --max-context, {counts['truncated_inputs']} "
          f"inputs truncated) to {args.output}")
    return 0


def _convert_sessions(args: argparse.Namespace) -> int:
    from vllm_mars.workload.sessions import CONVERTERS

    wfs = CONVERTERS[args.frontend](args.src, scale=args.scale, max_tool_s=args.max_tool_s)
    if not wfs:
        raise ValueError(f"{args.src}: no {args.frontend} session with an LLM call")
    n = write_workload(args.output, wfs)
    calls = sum(len(w.turns) for r in wfs for w in r.walk())
    kids = sum(len(list(r.walk())) - 1 for r in wfs)
    print(f"wrote {n} workflows ({kids} sub-agent children, {calls} calls) to {args.output}")
    return 0


def _convert_tracelab(args: argparse.Namespace) -> int:
    from vllm_mars.workload.tracelab import convert_csv

    n = write_workload(args.output, convert_csv(args.src, scale=args.scale,
                                                shared_first_prefix=not args.unshared_prefix))
    print(f"wrote {n} workflows to {args.output}")
    return 0


def workload_stats(path: str) -> dict:
    """Counts and token/tool statistics of a schema-v1 workload (validates it)."""
    roots = load_workload(path)
    allw = [w for r in roots for w in r.walk()]
    turns = [t for w in allw for t in w.turns]
    tools = [t.tool_s for w in allw for t in w.turns[:-1]]

    def pct(xs: list[float]) -> dict:
        xs = sorted(xs)
        if not xs:
            return {}
        return {"min": xs[0], "p50": xs[len(xs) // 2], "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1],
                "mean": round(statistics.fmean(xs), 3)}

    return {
        "path": path, "workflows": len(roots), "children": len(allw) - len(roots), "calls": len(turns),
        "turns_per_workflow": pct([len(w.turns) for w in roots]),
        "initial_tokens": pct([w.initial_tokens for w in allw]),
        "final_prompt_tokens": pct([w.final_prompt_tokens() for w in allw]),
        "append_tokens": pct([t.append_tokens for w in allw for t in w.turns[1:]]),
        "output_tokens": pct([t.output_tokens for t in turns]),
        "tool_s": pct(tools),
        "total_output_tokens": sum(t.output_tokens for t in turns),
        "total_tool_s": round(sum(tools), 3),
    }


def _stats(args: argparse.Namespace) -> int:
    s = workload_stats(args.path)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    for k, v in s.items():
        print(f"{k:22s} {v}")
    return 0
