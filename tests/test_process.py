"""The child-server helpers (``vllm_mars.process``) on real processes: a real HTTP server answers,
a process that dies first is named with its exit code, and a stopped group leaves no child behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_mars.process import free_port, stop_group, wait_http_ok


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is still in the group."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def test_waits_for_a_real_server_then_stops_its_whole_group(tmp_path):
    port = free_port()
    # the server runs as a grandchild (sh -> python): stopping the group must end it too
    proc = subprocess.Popen(["sh", "-c", f"{sys.executable} -m http.server {port} --bind 127.0.0.1; exit 0"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/", proc, 30, what="http.server", interval_s=0.1)
    finally:
        stop_group(proc, timeout=10)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10  # the orphaned grandchild is reaped by init, not by us
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.05)
    assert not _group_alive(proc.pid)  # no process of the group is left
    stop_group(proc)  # an exited process: nothing to do


def test_a_server_that_exits_first_is_named_with_its_code():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    with pytest.raises(RuntimeError, match=r"the server exited with code 3 before .* answered: see x.log"):
        wait_http_ok(f"http://127.0.0.1:{free_port()}/health", proc, 30, what="the server", interval_s=0.05,
                     detail=lambda: ": see x.log")


def test_a_server_that_never_answers_times_out():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        with pytest.raises(TimeoutError, match=r"the server did not answer .* within 0 s"):
            wait_http_ok(f"http://127.0.0.1:{free_port()}/health", proc, 0.3, what="the server", interval_s=0.05)
    finally:
        stop_group(proc, timeout=5)
