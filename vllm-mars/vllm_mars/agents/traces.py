"""What an agent run's traces become: the replayable workload (``workload.jsonl``) and the report's
sessions table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_mars.workload.schema import WorkloadLine


def session_workflow(trace: dict[str, Any]) -> dict[str, Any] | None:
    """One session's agent calls as a ``mars_workload`` workflow line: the first call's prompt, per
    later call the tokens its prompt grew by beyond the previous call's prompt and output (a prompt
    that shrank restarts it: schema v2 ``compact``), each call's output tokens, and the gap until the
    next call as its tool time. Side calls (no tools) are left out. None without an agent call."""
    calls = [c for c in trace["calls"] if c.get("has_tools") and c.get("prompt_tokens")]
    if not calls:
        return None
    turns: list[dict[str, Any]] = []
    prev_ctx = 0
    for k, c in enumerate(calls):
        t: dict[str, Any] = {"output_tokens": max(int(c.get("output_tokens") or 0), 1)}
        if k:
            grow = int(c["prompt_tokens"]) - prev_ctx
            if grow >= 0:
                t["append_tokens"] = grow
            else:
                t["compact"] = {"keep_tokens": int(c["prompt_tokens"]), "summary_tokens": 0}
            prev = calls[k - 1]
            turns[-1]["tool_s"] = round(max(c["submit_ts"] - (prev.get("end_ts") or prev["submit_ts"]), 0.0), 6)
        prev_ctx = int(c["prompt_tokens"]) + t["output_tokens"]
        turns.append(t)
    schema = "mars_workload_v2" if any("compact" in t for t in turns) else "mars_workload_v1"
    return {"schema": schema, "workflow_id": str(trace["task"]), "arrival_s": round(float(trace["start_ts"]), 6),
            "prompt_tokens": int(calls[0]["prompt_tokens"]), "turns": turns, "source": "mars agents run",
            "meta": {"frontend": trace.get("frontend"), "task": trace.get("task_id"),
                     "client_session": trace.get("client_session"), "solved": trace.get("solved"),
                     "side_calls": trace.get("side_calls")}}


def write_workload(traces: list[dict[str, Any]], path: Path) -> int:
    """What the run did as a replayable workload (``mars replay --workload PATH``); validated by the
    workload schema. Returns the number of workflows written."""
    rows = [w for w in (session_workflow(t) for t in sorted(traces, key=lambda t: t["start_ts"])) if w]
    base = min((w["arrival_s"] for w in rows), default=0.0)
    with open(path, "w") as f:
        for w in rows:
            w["arrival_s"] = round(w["arrival_s"] - base, 6)
            WorkloadLine.model_validate(w)
            f.write(json.dumps(w, separators=(",", ":")) + "\n")
    return len(rows)


def sessions_table(traces: list[dict[str, Any]]) -> str:
    """Markdown: one row per session (what report.md adds to the replay report)."""
    lines = ["", "## Sessions", "", ("| task | outcome | solved | tool calls | E2E (s) | calls (side) | prompt tok | "
             "output tok | client session | sidecar workflow |"), "|" + "---|" * 10]
    for t in sorted(traces, key=lambda t: t["task"]):
        outcome = "ok" if t["error"] is None else str(t["error"])[:60].replace("|", "/")
        solved = {True: "yes", False: "no"}.get(t.get("solved"), "-")
        lines.append(f"| {t['task']} | {outcome} | {solved} | {t.get('tool_calls', '-')} | {t['e2e_s']:.2f} | {len(t['calls'])} ({t['side_calls']}) | "
                     f"{t['prompt_tokens']} | {t['output_tokens']} | {t['client_session'] or '-'} | "
                     f"{', '.join(t['sidecar_workflows']) or '-'} |")
    return "\n".join(lines) + "\n"
