"""Where an agent CLI runs: its executable (:func:`find_cli`), the sandbox (bubblewrap: read-only
root, writes only in the session's directory, no network but a loopback port bridged to the
session's measuring proxy) and its clean environment (no user secrets)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from vllm_mars.agents.frontends import CliSettings, Frontend, SessionPaths
from vllm_mars.driver._sandbox_exec import bwrap_argv
from vllm_mars.driver.tools import detect_sandbox

_EXEC = str(Path(__file__).with_name("_agent_exec.py"))
#: the loopback port a sandboxed CLI calls (its own network namespace: any free number works)
BRIDGE_PORT = 8000


def find_cli(fe: Frontend, prefix: str | None = None) -> str:
    """The CLI's executable: in ``prefix`` (or $MARS_AGENTS_PREFIX, or this checkout's .agents), else
    on PATH. FileNotFoundError says how to install it."""
    roots = [prefix] if prefix else []
    if os.environ.get("MARS_AGENTS_PREFIX"):
        roots.append(os.environ["MARS_AGENTS_PREFIX"])
    roots.append(str(Path(__file__).resolve().parents[3] / ".agents"))
    for r in roots:
        exe = fe.executable(Path(r))
        if exe.exists():
            return str(exe)
    found = shutil.which(fe.binary) if fe.name != "openhands" else None  # not any python on PATH
    if found:
        return found
    raise FileNotFoundError(f"the {fe.name} CLI ({fe.binary}) is not installed (looked in "
                            f"{', '.join(roots)} and PATH): run scripts/setup_agents.sh")


def sandbox_mode(unsandboxed: bool) -> tuple[str, str | None]:
    """(``bwrap`` | ``none``, why none). Raises ValueError when bwrap is unusable and not opted out."""
    if unsandboxed:
        return "none", "unsandboxed by request (--unsandboxed)"
    if detect_sandbox() == "bwrap":
        return "bwrap", None
    raise ValueError("bubblewrap (bwrap) is not usable here, so the agent sessions cannot be sandboxed: install "
                     "it (scripts/setup_agents.sh does, as root) or pass --unsandboxed to run them without one")


def sandboxed_argv(cmd: list[str], paths: SessionPaths, sock_dir: str) -> list[str]:
    """``cmd`` under bubblewrap: writes only in ``paths.root`` (and ``sock_dir``, which holds the proxy's
    socket), no network but 127.0.0.1:BRIDGE_PORT, which leads to ``sock_dir/proxy.sock``."""
    inner = [sys.executable, "-I", _EXEC, "--port", str(BRIDGE_PORT), "--unix", f"{sock_dir}/proxy.sock",
             "--chdir", str(paths.workspace), "--", *cmd]
    return bwrap_argv(str(paths.root), inner, net=False, binds=(sock_dir,))


def bwrap_argv_plain(workspace: str, cmd: list[str]) -> list[str]:
    """``cmd`` under bubblewrap with no network, writing only in ``workspace`` (a task's check)."""
    return bwrap_argv(workspace, cmd, net=False)


def check_env() -> dict[str, str]:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}
    return {**keep, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}


def cli_env(fe: Frontend, paths: SessionPaths, settings: CliSettings) -> dict[str, str]:
    """A clean environment: PATH and locale from ours, the rest from the frontend (no user secrets)."""
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ", "SSL_CERT_FILE") if k in os.environ}
    return {**keep, **fe.env(paths, settings)}
