"""bubblewrap's private /tmp must not hide the program it runs: a checkout or venv under /tmp (CI
clones there) stays visible read-only, other /tmp content stays hidden."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from vllm_mars.driver._sandbox_exec import bwrap_argv
from vllm_mars.driver.tools import detect_sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or detect_sandbox() != "bwrap",
                                reason="bubblewrap is not usable here")


def test_program_under_tmp_runs_and_other_tmp_stays_hidden(tmp_path):
    with tempfile.TemporaryDirectory(prefix="mars-checkout-", dir="/tmp") as checkout, \
            tempfile.TemporaryDirectory(prefix="mars-other-", dir="/tmp") as other:
        prog = Path(checkout) / "bin" / "hello"
        prog.parent.mkdir()
        prog.write_text(f"#!/bin/sh\necho ran; cat {other}/secret 2>/dev/null || echo hidden\n"
                        f"touch {prog.parent}/written 2>/dev/null && echo wrote || echo readonly\n")
        prog.chmod(0o755)
        (Path(other) / "secret").write_text("s3cret")
        ws = tmp_path / "ws"
        ws.mkdir()
        for readable in (None, ["/usr", "/bin", "/lib", "/lib64", "/etc", str(prog.parent)]):
            r = subprocess.run(bwrap_argv(str(ws), [str(prog)], readable=readable), capture_output=True,
                               text=True, timeout=30, check=False)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == ["ran", "hidden", "readonly"], (readable, r.stdout, r.stderr)
