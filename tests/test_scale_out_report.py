"""``experiments/scale_out/scale_out.py report``: the committed record of runs whose run dirs live
on another machine (or are gone) survives a report from a checkout that lacks them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "scale_out" / "scale_out.py"
OUT = REPO / "experiments" / "results" / "scale_out"


def _report(out: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "report", "--out", str(out), "--work", str(work), *extra],
                          capture_output=True, text=True, timeout=300)


def test_report_without_run_dirs_keeps_every_recorded_run(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    shutil.copytree(OUT, out)
    work.mkdir()
    before = json.loads((out / "results.json").read_text())
    rows = json.loads((out / "rows.json").read_text())
    assert rows["rows"], "the committed table has runs"

    p = _report(out, work, "--print-only")
    assert p.returncode == 0, p.stderr
    assert p.stdout == (OUT / "scale_out.md").read_text(), "every recorded run is a row, in the file's order"
    assert (out / "results.json").read_text() == (OUT / "results.json").read_text(), "--print-only writes nothing"

    p = _report(out, work)
    assert p.returncode == 0, p.stderr
    after = json.loads((out / "results.json").read_text())
    assert after["cells"] == before["cells"] and after["missing_runs"] == before["missing_runs"]
    assert (out / "scale_out.md").read_text() == (OUT / "scale_out.md").read_text()
    assert json.loads((out / "rows.json").read_text()) == rows
    table = (out / "table.md").read_text()
    assert all(f"| {c['workload']} | {c['rps']:g} | {c['seed']} |" in table for c in before["cells"])
