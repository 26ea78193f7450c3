"""The embedded default comparison (`mars compare` with no arguments), recorded for RESULTS.md.

Runs exactly what `mars compare` runs by default (same parser, same defaults: the bundled compact
workload, the tiny CPU model, 48 KV blocks of 32 tokens, mars vs mars-no-admission vs fcfs) and writes
benchmark/perf/results/compare_default.json with the table, the per-policy numbers and the setup.

    .venv/bin/python benchmark/perf/compare_default.py [extra `mars compare` flags]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm_mars.cli import build_parser
    from vllm_mars.commands.driver import _floats, _quiet_engine, compare_config
    from vllm_mars.driver.compare import run_compare
    from vllm_mars.metrics.compare import format_table

    args = build_parser().parse_args(["compare", "--no-progress", *argv])
    _quiet_engine(args)
    cfg, policies = compare_config(args)
    out, record = run_compare(cfg, policies, _floats(args.rps_list, "--rps"), cfg.out)
    table = format_table(record)
    print(table)
    record.update({
        "command": "mars compare " + " ".join(argv) if argv else "mars compare",
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU",
        "python": platform.python_version(), "table_markdown": table, "out_dir": str(out),
    })
    dest = HERE / "results" / "compare_default.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {dest} (wall {record['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
