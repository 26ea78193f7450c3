"""Issue 35, holes 9, 13 and 15: inputs that were taken silently and went wrong later. Real CLIs
(``python -m vllm_mars.cli``), the real workload loader and the real agents runner (with a stand-in
for the agent CLI, which is all a flag-injection check needs)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPACT = REPO / "benchmark" / "workloads" / "compact.jsonl"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_mars.cli", *args], check=False, capture_output=True,
                          text=True,
                          timeout=300, env={**os.environ, "RPS": "1"})


# -- hole 15: --rps has a lower bound and is finite, at parse time --------------------------------------
@pytest.mark.parametrize("rps", ["1e-16", "0", "-1", "inf", "nan", "1e300"])
def test_rps_is_checked_at_parse_time(rps, tmp_path):
    r = _cli("replay", "--backend", "sim", "--workload", str(COMPACT), "--rps", rps, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--rps" in r.stderr and "rps must be" in r.stderr, r.stderr[-500:]
    assert not (tmp_path / "o").exists()  # nothing ran


def test_compare_rps_list_is_checked(tmp_path):
    r = _cli("compare", "--backend", "sim", "--profile", "h200-qwen3-coder-30b-a3b", "--workload", str(COMPACT),
             "--rps", "1,1e-16", "--out", str(tmp_path))
    assert r.returncode != 0 and "--rps" in r.stderr and ">= 0.001" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("rps", ["inf", "1e-16", "nan"])
def test_experiment_rps_is_checked_by_list(tmp_path, rps):
    exp = tmp_path / "exp.toml"
    exp.write_text(f'name = "x"\nbackend = "sim"\nprofile = "h200-qwen3-coder-30b-a3b"\npolicies = ["fcfs"]\n\n'
                   f'[[workloads]]\nname = "c"\npath = "{COMPACT}"\nrps = [2, {rps}]\n')
    r = _cli("experiment", "run", str(exp), "--list")
    assert r.returncode != 0 and "workloads[0].rps[1]" in r.stderr and "rps must be" in r.stderr, r.stderr[-500:]


# -- hole 13: workloads whose ids the engine would drop fail validation naming file:line:field ----------
def _line(wid: str, tool: str | None = None) -> str:
    turns = [{"output_tokens": 2, **({"tool": tool, "tool_s": 0.1} if tool else {})}, {"output_tokens": 2}]
    return json.dumps({"schema": "mars_workload_v1", "workflow_id": wid, "prompt_tokens": 8, "turns": turns})


@pytest.mark.parametrize(("lines", "where"), [
    ([_line("ok"), _line("w" * 1024)], ":2: workflow_id"),
    ([_line("ok"), _line("ok2"), _line("t", tool="x" * 100_000)], ":3: turns[0].tool"),
])
def test_workload_ids_the_engine_would_drop_are_rejected(tmp_path, lines, where):
    from vllm_mars.workload.schema import WorkloadError, load_workload

    p = tmp_path / "w.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(WorkloadError) as e:
        load_workload(p)
    assert f"{p}{where}" in str(e.value), str(e.value)[:300]


def test_longest_valid_workload_id_stays_a_valid_tag_when_repeated():
    from vllm_mars.workflow import MAX_ID_CHARS, workflow_from_extra_args
    from vllm_mars.workload.schema import MAX_WORKFLOW_ID_CHARS

    wid = "w" * MAX_WORKFLOW_ID_CHARS + "~99999"  # a replay's 100,000th repeat of it
    assert len(wid) <= MAX_ID_CHARS
    assert workflow_from_extra_args({"mars_workflow": wid}, "r").tagged


# -- hole 9: a task line is a prompt, never a flag; a session that did nothing is not "ok" --------------
FAKE_CLI = """#!/bin/sh
# a stand-in agent CLI: records its argv; a flag before "--" is obeyed (and exits 0 with no call)
printf '%s\\n' "$@" > ARGV_OUT
for a in "$@"; do
  [ "$a" = "--" ] && break
  [ "$a" = "--version" ] && { echo "fake 1.0"; exit 0; }
done
exit 0
"""


def test_agents_run_passes_prompt_after_double_dash_and_no_call_is_an_error(tmp_path):
    from vllm_mars.agents.runner import AgentRun, AgentRunConfig, Session
    from vllm_mars.agents.tasks import AgentTask

    argv_out = tmp_path / "argv.txt"
    exe = tmp_path / "codex"
    exe.write_text(FAKE_CLI.replace("ARGV_OUT", str(argv_out)))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    cfg = AgentRunConfig(frontend="codex", tasks="-", server="http://127.0.0.1:9", unsandboxed=True,
                         session_timeout_s=30, sample_interval_s=5)
    out = tmp_path / "run"
    out.mkdir()
    session = Session("t0", AgentTask("t0", ("--version",)), "codex")
    run = AgentRun(cfg, out, [session], {"codex": str(exe)}, "tiny", "none", "test")
    asyncio.run(run.run())
    argv = argv_out.read_text().splitlines()
    assert argv[-2:] == ["--", "--version"], argv
    (res,) = run.results
    assert res["error"] is not None and "no model call" in res["error"], res
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "workflow_error" for e in events)
    assert not any(e["event"] == "workflow_done" for e in events)
