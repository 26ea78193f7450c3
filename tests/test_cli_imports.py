"""``mars --help``, every subcommand's ``--help`` and the commands that need no engine run without
importing vLLM or torch (each costs seconds of CPU to import: ``mars --help`` once took 12 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: every --help of the command tree (walked from the parser), then the
# light commands given as JSON in argv[1]; prints the heavy top-level modules that got imported.
PROBE = """
import argparse, contextlib, io, json, sys
from vllm_mars.cli import build_parser, main

def helps(parser, path):
    yield [*path, "--help"]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from helps(sub, [*path, name])

runs = [*helps(build_parser(), []), *json.loads(sys.argv[1])]
codes = []
for argv in runs:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"vllm", "torch", "transformers"})
print(json.dumps({"runs": len(runs), "codes": codes, "heavy": heavy}))
"""


def test_help_and_commands_without_an_engine_import_no_vllm(tmp_path):
    light = [
        ["experiment", "readme", str(REPO / "experiments"), "--check"],
        ["experiment", "run", str(REPO / "experiments" / "studies" / "weka_traces.toml"), "--list"],
        ["workload-stats", str(REPO / "benchmark" / "workloads" / "compact.jsonl")],
        ["gen-workload", "--preset", "ILR-1", "--num-workflows", "2", "--scale", "64", "-o", str(tmp_path / "g.jsonl")],
        ["convert", "weka", str(REPO / "benchmark" / "workloads" / "weka_sample"), "-o", str(tmp_path / "w.jsonl"),
         "--scale", "16"],
    ]
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(light)], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    n = out["runs"] - len(light)
    assert n > 20  # mars, its commands and their subcommands
    assert out["codes"] == [0] * out["runs"], out["codes"]
    assert out["heavy"] == [], f"imported by --help or a command that needs no engine: {out['heavy']}"
    assert (tmp_path / "g.jsonl").is_file() and (tmp_path / "w.jsonl").is_file()
