"""Servers the package starts as child processes (``mars serve`` for an agent run, vLLM's OpenAI
server behind ``mars serve``, the test suite's servers): a free loopback port, waiting until one
answers, and stopping its process group. Ground floor: imports nothing of the package."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http_ok(url: str, proc: subprocess.Popen, timeout: float, *, what: str, interval_s: float = 0.5,
                 detail: Callable[[], str] = str) -> None:
    """Return once GET ``url`` answers 200. RuntimeError when ``proc`` (``what``) exits first,
    TimeoutError after ``timeout`` seconds; both messages end with ``detail()`` (say, where its log is)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before {url} answered{detail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{what} did not answer {url} within {timeout:.0f} s{detail()}")


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM ``proc``'s process group (it was started with ``start_new_session=True``), SIGKILL it
    after ``timeout`` seconds, and reap ``proc``. Nothing when it has already exited."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to process group ``pgid``: what is left of a stopped server (its engine core,
    workers) even after the group's leader exited. Nothing when the group is already gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
