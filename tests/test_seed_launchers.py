"""The MARS preview's launchers under its names (experiments/scripts/, scripts/create_continuum_vllm_conda_env.sh):
each maps the preview's variables onto one mars command (scripts/lib/seed_env.sh), says what it did
with a variable that has no meaning here, and the preview's README walkthrough (steps 1-4, its
variable names) runs on the CPU build."""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "experiments" / "scripts"
SEED_MODEL = "/nonexistent/models/Qwen3-Coder-30B-A3B-Instruct"  # the preview's default, absent here
AGENTS_BIN = REPO / ".agents" / "node_modules" / ".bin"


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in {
        "MODEL_PATH", "TASKS_PATH", "NUM_REQUESTS", "MAX_REQUESTS", "RPS", "EMIT_MODE", "SCHEDULING_POLICY",
        "AGENTS", "TARGETS", "POLICIES", "GPU", "CUDA_VISIBLE_DEVICES", "OUTPUT_DIR", "URL", "MARS_BIN",
        "SEED_GPU_NOTED", "OPENHANDS_PYTHON", "OPENHANDS_VENV", "CPU_SERVER", "CPU_AGENT"}}
    env["MARS_PYTHON"] = sys.executable
    env["SEED_HAS_GPU"] = "0"
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _run(script: str | Path, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / script)], env=_env(**kw), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _dry(script: str, **kw) -> tuple[list[list[str]], str]:
    r = _run(script, DRY_RUN=1, **kw)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines()], r.stderr


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--") and not b.startswith("--")}


MARS = [sys.executable, "-m", "vllm_mars.cli"]


def test_task_driver_launcher_maps_the_preview_variables():
    (argv,), err = _dry("experiments/scripts/run_baseline_continuum.sh", MODEL_PATH=SEED_MODEL,
                        TASKS_PATH="benchmark/workloads/compact.jsonl", NUM_REQUESTS=100, RPS=0.2,
                        EMIT_MODE="poisson", SCHEDULING_POLICY="fcfs", CPU_GPU="0", CPU_TOOL="1", TP=2,
                        GPU_MEMORY_UTILIZATION=0.85, MAX_MODEL_LEN=8192, CUDA_VISIBLE_DEVICES=0,
                        MAX_REQUESTS=7, CPU_SERVER="0-1")
    assert argv[:4] == [*MARS, "replay"]
    f = _flags(argv)
    assert (f["--policy"], f["--rps"], f["--arrival"], f["--workload"], f["--num-workflows"]) == \
        ("fcfs", "0.2", "poisson", "benchmark/workloads/compact.jsonl", "100")
    assert (f["--cpu-gpu"], f["--cpu-tool"], f["--max-model-len"]) == ("0", "1", "8192")
    assert "tensor_parallel_size=2" in argv and "gpu_memory_utilization=0.85" in argv
    assert "--model" not in argv  # the preview's 30B default is not here and there is no GPU: the tiny model
    for said in ("MODEL_PATH=" + SEED_MODEL + " is not a local directory and there is no GPU: using the tiny",
                 "GPU/CUDA_VISIBLE_DEVICES=0: no GPU here, running on the CPU build",
                 "MAX_REQUESTS=7: the task driver counts NUM_REQUESTS; ignored",
                 "CPU_SERVER=0-1: the task driver has no server"):
        assert said in err, err
    # a model directory that exists is used; on a GPU machine the path is passed on as given
    (argv,), _ = _dry("experiments/scripts/run_baseline_continuum.sh", MODEL_PATH=str(REPO))
    assert _flags(argv)["--model"] == str(REPO)
    (argv,), _ = _dry("experiments/scripts/run_baseline_continuum.sh", MODEL_PATH=SEED_MODEL, SEED_HAS_GPU=1, GPU=3)
    assert _flags(argv)["--model"] == SEED_MODEL


def _parses(argv: list[str]) -> None:
    """The printed command is one mars itself accepts (flags and their values), checked without running it."""
    from vllm_mars.cli import build_parser
    from vllm_mars.commands.agents import _config

    assert argv[:3] == MARS
    args = build_parser().parse_args(argv[3:])
    if argv[3] == "agents":
        _config(args)  # the run's own validation (server or model path, rps, arrival, ...)


def test_live_launchers_call_mars_agents_run():
    (argv,), err = _dry("experiments/scripts/run_openhands_qwen3_local.sh", MODEL_PATH=str(REPO),
                        TASKS_PATH="t.jsonl", MAX_REQUESTS=20, RPS=0.2, SCHEDULING_POLICY="fcfs", CPU_SERVER="0",
                        CPU_AGENT="1", OPENHANDS_VENV="/opt/oh", NUM_REQUESTS=5, MAX_MODEL_LEN=32768, TP=2,
                        EMIT_MODE="trace")
    assert argv[:5] == [*MARS, "agents", "run"]
    _parses(argv)
    f = _flags(argv)
    assert (f["--frontend"], f["--tasks"], f["--max-requests"], f["--rps"], f["--policy"], f["--model-path"],
            f["--arrival"]) == ("openhands", "t.jsonl", "20", "0.2", "fcfs", str(REPO), "fixed")
    assert "--serve-arg=--max-model-len=32768" in argv and "--serve-arg=--engine-arg=tensor_parallel_size=2" in argv
    for said in ("NUM_REQUESTS=5: live runs count MAX_REQUESTS; ignored",
                 "EMIT_MODE=trace: live sessions have no recorded arrivals",
                 "OPENHANDS_VENV/OPENHANDS_PYTHON=/opt/oh: mars agents run uses the OpenHands venv at"):
        assert said in err, err
    # the CPU build's tiny model plays the tasks' scripts (a random model never calls a tool)
    (argv,), err = _dry("experiments/scripts/run_agent_cli_local.sh", MODEL_PATH=SEED_MODEL)
    _parses(argv)
    f = _flags(argv)
    assert f["--scripted"] == f["--tasks"] == "benchmark/tasks/coding.jsonl" and f["--model"] == "tiny"
    assert "tiny CPU model plays the tasks' scripted solutions" in err
    # a running server: --server, and the engine sizing is the server's own (said so)
    (argv,), err = _dry("experiments/scripts/run_agent_cli_local.sh", AGENTS="codex opencode", URL="http://x:8000",
                        MAX_MODEL_LEN=4096)
    f = _flags(argv)
    assert (f["--frontend"], f["--server"]) == ("codex,opencode", "http://x:8000")
    assert not any(a.startswith("--serve-arg") for a in argv) and "--policy" not in f
    assert "URL=http://x:8000: the server is already running" in err
    _parses(argv)
    lines, _ = _dry("experiments/scripts/run_agent_cli_smoke.sh", MODEL_PATH=str(REPO))
    assert [(_flags(a)["--frontend"], _flags(a)["--max-requests"]) for a in lines] == [("codex", "1"), ("opencode", "1")]
    for a in lines:
        _parses(a)


@pytest.mark.parametrize("script, env, said", [
    ("experiments/scripts/run_baseline_continuum.sh", {"EMIT_MODE": "bursty"}, "EMIT_MODE=bursty unknown; allowed: rps, poisson, trace"),
    ("experiments/scripts/run_agent_cli_local.sh", {"AGENTS": "codex,claude"}, "unknown agent 'claude'; allowed: codex, opencode"),
    ("experiments/scripts/run_policy_smoke_gpu1.sh", {"TARGETS": "vllm sglang", "POLICIES": "fcfs"},
     "unknown target 'sglang'; allowed: vllm, openhands, codex, opencode"),
])
def test_launchers_refuse_unknown_values(script, env, said):
    r = _run(script, DRY_RUN=1, **env)
    assert r.returncode == 2 and said in r.stderr, r.stderr


def test_policy_smoke_runs_every_policy_over_the_four_targets():
    from vllm_mars.driver.control import driver_policy_names

    policies = driver_policy_names()
    lines, err = _dry("experiments/scripts/run_policy_smoke_gpu1.sh", OUT_ROOT="o")
    got = {(a[3] if a[3] == "replay" else _flags(a)["--frontend"], _flags(a)["--policy"]) for a in lines}
    runnable = [p for p in policies if p != "infercept_swap"]  # no GPU here
    assert got == {(t, p) for t in ("replay", "openhands", "codex", "opencode") for p in runnable}
    assert err.count("infercept_swap skipped: infercept_swap swaps KV") == 4
    assert {_flags(a).get("--num-workflows") or _flags(a)["--max-requests"] for a in lines} == {"200", "50", "20"}
    # with a GPU it runs too, with its KV offloading connector
    lines, _ = _dry("experiments/scripts/run_policy_smoke_gpu1.sh", SEED_HAS_GPU=1, POLICIES="infercept_swap",
                    TARGETS="vllm")
    assert lines[0][lines[0].index("kv_offloading_size=4") - 1] == "--engine-arg"
    # scripts/smoke_policies.sh is the same loop over the task driver
    lines, _ = _dry("scripts/smoke_policies.sh", POLICIES="fcfs,mars")
    assert [_flags(a)["--policy"] for a in lines] == ["fcfs", "mars"]


def test_setup_launchers_say_what_they_do_instead():
    (argv,), err = _dry("scripts/create_continuum_vllm_conda_env.sh", MODE="source", CUDA_VERSION_OVERRIDE="12.8",
                        PATH="/usr/bin:/bin")
    assert argv == ["scripts/setup.sh"]
    assert "MODE=source: nothing to build" in err and "CUDA_VERSION_OVERRIDE=12.8: not used" in err
    (argv,), err = _dry("experiments/scripts/setup_agent_cli.sh", PYTHON_BIN="/usr/bin/python3")
    assert argv == ["scripts/setup_agents.sh"] and "PYTHON_BIN=/usr/bin/python3: the agent CLIs are npm" in err


@pytest.mark.timeout(2400)  # four engine starts and a live session; minutes on a shared 2-core box
def test_seed_walkthrough_runs_on_the_cpu_build(tmp_path):
    """The preview README's "End-to-End Walkthrough", steps 1-4 with its variable names, kept short
    (2 workflows; 1 session or workflow per policy)."""
    base = {"MODEL_PATH": SEED_MODEL, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "SEED_HAS_GPU": ""}
    if subprocess.run(["bash", "-c", "command -v nvidia-smi && nvidia-smi -L"], capture_output=True).returncode == 0:
        pytest.skip("the walkthrough test is for the CPU build")
    # Step 1: a small task-driver job
    r = _run("experiments/scripts/run_baseline_continuum.sh", timeout=600, CUDA_VISIBLE_DEVICES=0, NUM_REQUESTS=2,
             RPS=2, SCHEDULING_POLICY="mars", OUTPUT_DIR=tmp_path / "step1", **base)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "step1" / "summary.json").read_text())
    assert summary["completed"] == 2 and summary["errors"] == 0 and summary["policy"] == "mars"
    # Steps 2 and 3: OpenHands and Codex jobs: mars agents run, which starts mars serve with the
    # scripted tiny model (each session does real tool calls); run live where the frontend is installed
    for script, env, installed in (("run_openhands_qwen3_local.sh", {}, REPO / ".agents" / "openhands" / "bin" / "python"),
                                   ("run_agent_cli_local.sh", {"AGENTS": "codex"}, AGENTS_BIN / "codex")):
        kw = {"CUDA_VISIBLE_DEVICES": 0, "MAX_REQUESTS": 1, "RPS": 0.2, "SCHEDULING_POLICY": "mars",
              "OUTPUT_DIR": tmp_path / script, **env, **base}
        (argv,), _ = _dry(f"experiments/scripts/{script}", **kw)
        _parses(argv)
        if not installed.exists():
            continue  # scripts/setup_agents.sh did not install it here; CI's does
        r = _run(f"experiments/scripts/{script}", timeout=900, **kw)
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads((tmp_path / script / "summary.json").read_text())
        assert summary["completed"] == 1 and summary["errors"] == 0
    # Step 4: compare selected policies: the task driver for real (each live target x policy would start
    # a server of its own: steps 2 and 3 ran those paths), the live targets as the commands mars accepts
    step4 = {"GPU": 0, "POLICIES": "fcfs mars", "VLLM_REQUESTS": 1, "OPENHANDS_REQUESTS": 1, "AGENT_CLI_REQUESTS": 1,
             "OUT_ROOT": tmp_path / "step4", **base}
    r = _run("experiments/scripts/run_policy_smoke_gpu1.sh", timeout=900, TARGETS="vllm", **step4)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "step4" / "summary.tsv").open(), delimiter="\t"))
    assert {(x["target"], x["policy"], x["status"]) for x in rows} == {("vllm", "fcfs", "ok"), ("vllm", "mars", "ok")}
    for x in rows:
        assert json.loads((Path(x["run_dir"]) / "summary.json").read_text())["errors"] == 0
    lines, _ = _dry("experiments/scripts/run_policy_smoke_gpu1.sh", TARGETS="vllm openhands codex", **step4)
    assert len(lines) == 6 and {a[3] for a in lines} == {"replay", "agents"}
    for a in lines:
        _parses(a)
