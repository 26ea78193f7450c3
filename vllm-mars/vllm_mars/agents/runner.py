"""``mars agents run``: N concurrent real agent-CLI sessions against a server, as a run directory.

Each session runs the CLI non-interactively (``codex exec --json``, ``opencode run --format json``)
in its own directory (``sessions/<task>/{workspace,home}``), inside bubblewrap: read-only root,
writes only in that directory, its own network namespace whose only way out is a loopback port
bridged to the session's measuring proxy (:mod:`vllm_mars.agents.proxy`), which forwards to
``--server``. Without a usable bwrap the run refuses unless ``unsandboxed`` is set, and then says so
in ``run_start`` and a ``sandbox_off`` event. A session's prompts after the first resume it
(``codex exec resume ID``, ``opencode run --session ID``). Each session has a timeout (its
process group is killed).

The run directory has the format of ``mars replay``'s: ``run_config.json``, ``events.jsonl``
(``workflow_arrive``/``start``/``done``, ``call_submit``/``first_token``/``end`` per proxied call,
``cli_exit`` per CLI run, ``agent_done``, ``kv_sample`` from the server's /metrics), ``traces.jsonl``
(one line per session), ``summary.json`` and ``report.md`` (:mod:`vllm_mars.metrics`). Never
imports vllm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_mars.agents.frontends import CliSettings, Frontend, SessionPaths, get_frontend
from vllm_mars.agents.proxy import CallRecord, SessionProxy
from vllm_mars.agents.tasks import AgentTask, load_agent_tasks
from vllm_mars.driver.runner import RunClock, default_out_dir
from vllm_mars.metrics.events import EventLog
from vllm_mars.workflow import safe_dirname

logger = logging.getLogger(__name__)

_EXEC = str(Path(__file__).with_name("_agent_exec.py"))
#: the loopback port a sandboxed CLI calls (its own network namespace: any free number works)
BRIDGE_PORT = 8000
_TAIL = 2000


@dataclass
class AgentRunConfig:
    """Everything ``mars agents run`` reads (flags map 1:1)."""

    frontend: str
    tasks: str
    #: the server's base URL (``mars serve`` / the sidecar, or any OpenAI-compatible server)
    server: str
    concurrency: int = 1
    #: served model name (default: the server's first in /v1/models)
    model: str | None = None
    session_timeout_s: float = 600.0
    #: follow-up prompts continue the CLI's last session (``resume --last`` / ``--continue``) instead
    #: of naming it by id
    resume_last: bool = False
    #: run the CLIs without bubblewrap (required where bwrap is not usable)
    unsandboxed: bool = False
    #: npm prefix holding the CLIs (default $MARS_AGENTS_PREFIX, else ./.agents, else PATH)
    agents_prefix: str | None = None
    api_key: str | None = None
    context_window: int = 32768
    max_output_tokens: int | None = None
    sample_interval_s: float = 0.5
    out: str | None = None

    def validate(self) -> None:
        get_frontend(self.frontend)
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.session_timeout_s <= 0:
            raise ValueError(f"--session-timeout must be > 0, got {self.session_timeout_s}")
        if not self.server.startswith(("http://", "https://")):
            raise ValueError(f"--server {self.server!r} must start with http:// or https://")
        if self.context_window < 1 or (self.max_output_tokens is not None and self.max_output_tokens < 1):
            raise ValueError("--context-window and --max-output-tokens must be >= 1")

    @property
    def server_root(self) -> str:
        """The server URL without a trailing /v1."""
        s = self.server.rstrip("/")
        return s.removesuffix("/v1")


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
    from vllm_mars.driver.tools import detect_sandbox

    if detect_sandbox() == "bwrap":
        return "bwrap", None
    raise ValueError("bubblewrap (bwrap) is not usable here, so the agent sessions cannot be sandboxed: install "
                     "it (scripts/setup_agents.sh does, as root) or pass --unsandboxed to run them without one")


def sandboxed_argv(cmd: list[str], paths: SessionPaths, sock_dir: str) -> list[str]:
    """``cmd`` under bubblewrap: writes only in ``paths.root`` (and ``sock_dir``, which holds the proxy's
    socket), no network but 127.0.0.1:BRIDGE_PORT, which leads to ``sock_dir/proxy.sock``."""
    from vllm_mars.driver._sandbox_exec import bwrap_argv

    inner = [sys.executable, "-I", _EXEC, "--port", str(BRIDGE_PORT), "--unix", f"{sock_dir}/proxy.sock",
             "--chdir", str(paths.workspace), "--", *cmd]
    return bwrap_argv(str(paths.root), inner, net=False, binds=(sock_dir,))


def _safe(s: str) -> str:
    return safe_dirname(s)  # one directory per session, never "." or ".." (the one encoder)


def bwrap_argv_plain(workspace: str, cmd: list[str]) -> list[str]:
    """``cmd`` under bubblewrap with no network, writing only in ``workspace`` (a task's check)."""
    from vllm_mars.driver._sandbox_exec import bwrap_argv

    return bwrap_argv(workspace, cmd, net=False)


def _check_env() -> dict[str, str]:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL") if k in os.environ}
    return {**keep, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}


def _cli_env(fe: Frontend, paths: SessionPaths, settings: CliSettings) -> dict[str, str]:
    """A clean environment: PATH and locale from ours, the rest from the frontend (no user secrets)."""
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ", "SSL_CERT_FILE") if k in os.environ}
    return {**keep, **fe.env(paths, settings)}


class AgentRun:
    """One run: ``await run()``; files under ``out``."""

    def __init__(self, cfg: AgentRunConfig, out: Path, tasks: list[AgentTask], exe: str, model: str,
                 sandbox: str, sandbox_note: str | None) -> None:
        self.cfg, self.out, self.tasks, self.exe, self.model = cfg, out, tasks, exe, model
        self.fe = get_frontend(cfg.frontend)
        self.sandbox, self.sandbox_note = sandbox, sandbox_note
        self.clock = RunClock()
        self.events = EventLog(out / "events.jsonl", self.clock)
        self.traces = open(out / "traces.jsonl", "w", buffering=1)  # noqa: SIM115 (closed in run)
        self.results: list[dict[str, Any]] = []

    # -- per call (from the proxy) ---------------------------------------------------------------
    def _on_call(self, r: CallRecord) -> None:
        rid = f"{r.session}:c{r.index}"
        base = {"workflow": r.session, "root": r.session, "turn": r.index, "request_id": rid}
        self.events.emit("call_submit", ts=r.submit_ts, path=r.path, sent=r.sent, tools=r.has_tools, **base)
        ttft = None if r.first_byte_ts is None else round(r.first_byte_ts - r.submit_ts, 6)
        if ttft is not None:
            self.events.emit("call_first_token", ts=r.first_byte_ts, ttft_s=ttft, **base)
        self.events.emit("call_end", ts=r.end_ts, status=r.status, prompt_tokens=r.prompt_tokens or 0,
                         cached_tokens=r.cached_tokens, output_tokens=r.output_tokens or 0, ttft_s=ttft,
                         latency_s=round((r.end_ts or r.submit_ts) - r.submit_ts, 6),
                         sidecar_workflow=r.workflow, sidecar_root=r.root, side_call=not r.has_tools,
                         error=r.error, **base)

    # -- one session -----------------------------------------------------------------------------
    def _argv(self, cmd: list[str], paths: SessionPaths, sock_dir: str | None) -> list[str]:
        return sandboxed_argv(cmd, paths, sock_dir) if self.sandbox == "bwrap" else cmd

    async def _cli(self, argv: list[str], env: dict[str, str], cwd: Path, deadline: float,
                   log_base: Path) -> tuple[int | None, bool, str, str]:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=str(cwd), env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        timed_out = False
        try:
            out_b, err_b = await asyncio.wait_for(proc.communicate(), max(deadline - time.monotonic(), 0.01))
        except (TimeoutError, asyncio.CancelledError) as e:
            timed_out = isinstance(e, TimeoutError)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out_b, err_b = await proc.communicate()
            if not timed_out:
                raise
        out, err = out_b.decode(errors="replace"), err_b.decode(errors="replace")
        log_base.with_suffix(".stdout").write_text(out)
        log_base.with_suffix(".stderr").write_text(err)
        return proc.returncode, timed_out, out, err

    async def _session(self, task: AgentTask, slots: asyncio.Semaphore) -> None:
        async with slots:
            await self._session_in_slot(task)

    async def _session_in_slot(self, task: AgentTask) -> None:
        key = task.task_id
        paths = SessionPaths(self.out / "sessions" / _safe(key)).make()
        for f in task.files:
            p = paths.workspace / f.path
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f.content)
        sock_dir = tempfile.mkdtemp(prefix="mars-agent-") if self.sandbox == "bwrap" else None
        proxy = SessionProxy(self.cfg.server_root, key, self.clock, self._on_call,
                             unix_path=f"{sock_dir}/proxy.sock" if sock_dir else None)
        self.events.emit("workflow_arrive", workflow=key, root=key, task=key, prompts=len(task.prompts))
        t0 = self.clock()
        self.events.emit("workflow_start", workflow=key, root=key)
        cli_runs: list[dict[str, Any]] = []
        client_session: str | None = None
        error: str | None = None
        deadline = time.monotonic() + self.cfg.session_timeout_s
        try:
            await proxy.start()
            base_url = f"http://127.0.0.1:{BRIDGE_PORT}/v1" if sock_dir else proxy.base_url
            settings = CliSettings(base_url=base_url, model=self.model, api_key=self.cfg.api_key or "mars",
                                   context_window=self.cfg.context_window,
                                   max_output_tokens=self.cfg.max_output_tokens)
            self.fe.write_config(paths, settings)
            env = _cli_env(self.fe, paths, settings)
            for k, prompt in enumerate(task.prompts):
                if k and client_session is None:
                    error = "cannot resume: the first run reported no session id"
                    break
                cmd = self.fe.argv(self.exe, prompt, resume=client_session if k else None,
                                   continue_last=bool(k) and self.cfg.resume_last, workdir=str(paths.workspace))
                if cmd[-1] == prompt:  # "--": a task line such as "--version" is a prompt, never a flag
                    cmd = [*cmd[:-1], "--", prompt]
                rc, timed_out, stdout, stderr = await self._cli(self._argv(cmd, paths, sock_dir), env,
                                                                paths.workspace, deadline, paths.root / f"cli-{k}")
                parsed = self.fe.parse(stdout)
                client_session = parsed.session_id or client_session
                run = {"prompt": k, "rc": rc, "timed_out": timed_out, "client_session": parsed.session_id,
                       "steps": parsed.steps, "tool_calls": parsed.tool_calls, "input_tokens": parsed.input_tokens,
                       "cached_tokens": parsed.cached_tokens, "output_tokens": parsed.output_tokens,
                       "errors": parsed.errors, "final_text_tail": (parsed.final_text or "")[-200:],
                       "stderr_tail": stderr[-_TAIL:] if rc else ""}
                cli_runs.append(run)
                self.events.emit("cli_exit", workflow=key, root=key, **{k2: v for k2, v in run.items()
                                                                        if k2 != "final_text_tail"})
                if timed_out:
                    error = f"session timeout after {self.cfg.session_timeout_s:g} s"
                    break
                if rc != 0:
                    error = f"{self.fe.name} exited with code {rc}: {stderr.strip()[-300:]}"
                    break
        except Exception as e:  # noqa: BLE001 (recorded as the session's error)
            error = f"{type(e).__name__}: {e}"[:500]
        finally:
            await proxy.close()
            if sock_dir:
                shutil.rmtree(sock_dir, ignore_errors=True)
        end = self.clock()
        solved, check = await self._check(task, paths) if task.check else (None, None)
        if check is not None:
            self.events.emit("task_check", workflow=key, root=key, solved=solved, **check)
        calls = proxy.calls
        if error is None and not calls:  # a CLI that exited 0 without one model call did not do the task
            error = f"{self.fe.name} made no model call"
        wfs = sorted({c.workflow for c in calls if c.workflow})
        summary = {"workflow": key, "root": key, "client_session": client_session, "sidecar_workflows": wfs,
                   "calls": len(calls), "side_calls": sum(1 for c in calls if not c.has_tools),
                   "tool_calls": sum(r.get("tool_calls", 0) for r in cli_runs), "solved": solved,
                   "prompt_tokens": sum(c.prompt_tokens or 0 for c in calls),
                   "output_tokens": sum(c.output_tokens or 0 for c in calls)}
        if error is None:
            self.events.emit("workflow_done", root_done=True, **summary)
        else:
            self.events.emit("workflow_error", root_done=True, error=error, **summary)
        self.events.emit("agent_done", workflow=key, rounds=len(calls), parse_failures=0,
                         outcome="completed" if error is None else ("timeout" if "timeout" in error else "error"))
        trace = {**summary, "task": key, "start_ts": t0, "end_ts": end, "e2e_s": end - t0, "error": error,
                 "cli": cli_runs, "calls": [asdict(c) for c in calls]}
        self.traces.write(json.dumps(trace, separators=(",", ":")) + "\n")
        self.results.append(trace)
        print(f"[agents] {key}: {'ok' if error is None else error[:120]} ({end - t0:.1f} s, {len(calls)} calls, "
              f"session {client_session}, workflow {','.join(wfs) or '-'})", file=sys.stderr)

    async def _check(self, task: AgentTask, paths: SessionPaths) -> tuple[bool, dict[str, Any]]:
        """Run the task's check in its workspace (in the sandbox when there is one): solved = exit 0."""
        cmd = ["bash", "-c", task.check or "false"]
        argv = bwrap_argv_plain(str(paths.workspace), cmd) if self.sandbox == "bwrap" else cmd
        proc = await asyncio.create_subprocess_exec(*argv, cwd=str(paths.workspace), env=_check_env(),
                                                    stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = await proc.communicate()
        return proc.returncode == 0, {"check": task.check, "check_rc": proc.returncode,
                                      "check_tail": out.decode(errors="replace")[-300:]}

    # -- the server's own gauges ---------------------------------------------------------------------
    async def _sampler(self) -> None:
        import aiohttp

        names = {"mars_admission_active": "active", "mars_admission_queued": "queued",
                 "mars_admission_limit": "limit", "mars_sidecar_in_flight": "in_flight"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while True:
                try:
                    async with s.get(self.cfg.server_root + "/metrics") as r:
                        text = await r.text()
                    vals: dict[str, float] = {}
                    for line in text.splitlines():
                        name, _, v = line.partition(" ")
                        if name in names:
                            vals[names[name]] = float(v)
                    if vals:
                        self.events.emit("kv_sample", **{k: int(v) for k, v in vals.items()})
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                await asyncio.sleep(self.cfg.sample_interval_s)

    async def run(self) -> None:
        self.clock.start()
        self.events.emit("run_start", epoch=self.clock.epoch, policy=f"agents-{self.fe.name}", controller=None,
                         backend="http", workload=self.cfg.tasks, rps=None, frontend=self.fe.name,
                         cli=self.exe, concurrency=self.cfg.concurrency, server=self.cfg.server, model=self.model,
                         workflows=len(self.tasks), sandbox=self.sandbox, t_ideal_source=None)
        if self.sandbox_note:
            self.events.emit("sandbox_off", reason=self.sandbox_note)
        slots = asyncio.Semaphore(self.cfg.concurrency)
        sampler = asyncio.create_task(self._sampler())
        try:
            await asyncio.gather(*(self._session(t, slots) for t in self.tasks))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            self.events.emit("run_end", sessions=len(self.results),
                             failed=sum(1 for r in self.results if r["error"]))
            self.events.close()
            self.traces.close()


def server_model(server_root: str, api_key: str | None) -> str:
    """The first model the server lists (GET /v1/models)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server_root + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())
        return str(data["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--server {server_root}: cannot list its models ({e}); is it up? (or pass --model)") from None


def run_agents(cfg: AgentRunConfig) -> Path:
    """Run the sessions; write and return the run directory (summary.json and report.md included)."""
    from vllm_mars.metrics.events import read_events
    from vllm_mars.metrics.report import write_run_report
    from vllm_mars.metrics.summary import summarize

    cfg.validate()
    fe = get_frontend(cfg.frontend)
    exe = find_cli(fe, cfg.agents_prefix)
    tasks = load_agent_tasks(cfg.tasks)
    sandbox, note = sandbox_mode(cfg.unsandboxed)
    if sandbox == "none":
        logger.warning("agent sessions run without a sandbox: %s", note)
    model = cfg.model or server_model(cfg.server_root, cfg.api_key)
    out = Path(cfg.out) if cfg.out else default_out_dir(f"agents-{fe.name}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(json.dumps({**asdict(cfg), "cli": exe, "model": model,
                                                     "sandbox": sandbox}, indent=2) + "\n")
    asyncio.run(AgentRun(cfg, out, tasks, exe, model, sandbox, note).run())
    summary = summarize(read_events(out))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = write_run_report(out, summary)
    with open(report, "a") as f:
        f.write(sessions_table([json.loads(x) for x in (out / "traces.jsonl").read_text().splitlines()]))
    return out


def sessions_table(traces: list[dict[str, Any]]) -> str:
    """Markdown: one row per session (what report.md adds to the replay report)."""
    lines = ["", "## Sessions", "", ("| task | outcome | E2E (s) | calls (side) | prompt tok | output tok | "
             "client session | sidecar workflow |"), "|" + "---|" * 8]
    for t in sorted(traces, key=lambda t: t["task"]):
        outcome = "ok" if t["error"] is None else str(t["error"])[:60].replace("|", "/")
        lines.append(f"| {t['task']} | {outcome} | {t['e2e_s']:.2f} | {len(t['calls'])} ({t['side_calls']}) | "
                     f"{t['prompt_tokens']} | {t['output_tokens']} | {t['client_session'] or '-'} | "
                     f"{', '.join(t['sidecar_workflows']) or '-'} |")
    return "\n".join(lines) + "\n"
