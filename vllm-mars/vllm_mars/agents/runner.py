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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp

from vllm_mars.agents.config import AgentRunConfig, Session, plan_sessions
from vllm_mars.agents.frontends import CliSettings, Frontend, SessionPaths, get_frontend
from vllm_mars.agents.proxy import CallRecord, SessionProxy
from vllm_mars.agents.sandbox import (
    BRIDGE_PORT,
    bwrap_argv_plain,
    check_env,
    cli_env,
    find_cli,
    sandbox_mode,
    sandboxed_argv,
)
from vllm_mars.agents.serve import ServeProcess, server_model
from vllm_mars.agents.tasks import AgentTask, load_agent_tasks
from vllm_mars.agents.traces import sessions_table, write_workload
from vllm_mars.driver.runner import RunClock, default_out_dir
from vllm_mars.metrics.compare import compare_record, write_compare_report
from vllm_mars.metrics.events import EventLog, read_events
from vllm_mars.metrics.report import write_run_report
from vllm_mars.metrics.summary import summarize
from vllm_mars.policies import get_policy_class
from vllm_mars.workflow import safe_dirname

logger = logging.getLogger(__name__)

_TAIL = 2000


def _safe(s: str) -> str:
    return safe_dirname(s)  # one directory per session, never "." or ".." (the one encoder)


class AgentRun:
    """One run: ``await run()``; files under ``out``."""

    def __init__(self, cfg: AgentRunConfig, out: Path, sessions: list[Session], exes: dict[str, str], model: str,
                 sandbox: str, sandbox_note: str | None, label: str | None = None) -> None:
        self.cfg, self.out, self.sessions, self.exes, self.model = cfg, out, sessions, exes, model
        self.label = label or f"agents-{'+'.join(cfg.frontends)}"
        #: the vLLM server behind the sidecar, when known (its preemptions and KV usage are sampled)
        self.engine_url: str | None = None
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
        argv = sandboxed_argv(cmd, paths, sock_dir) if self.sandbox == "bwrap" else cmd
        return ["taskset", "-c", self.cfg.cpu_agent, *argv] if self.cfg.cpu_agent else argv

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

    async def _session(self, s: Session, slots: asyncio.Semaphore) -> None:
        await asyncio.sleep(max(s.offset - self.clock(), 0.0))
        async with slots:
            await self._session_in_slot(s.task, s.key, get_frontend(s.frontend), self.exes[s.frontend])

    async def _session_in_slot(self, task: AgentTask, key: str, fe: Frontend, exe: str) -> None:
        paths = SessionPaths(self.out / "sessions" / _safe(key)).make()
        for f in task.files:
            p = paths.workspace / f.path
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f.content)
        sock_dir = tempfile.mkdtemp(prefix="mars-agent-") if self.sandbox == "bwrap" else None
        proxy = SessionProxy(self.cfg.server_root, key, self.clock, self._on_call,
                             unix_path=f"{sock_dir}/proxy.sock" if sock_dir else None)
        self.events.emit("workflow_arrive", workflow=key, root=key, task=task.task_id, frontend=fe.name,
                         prompts=len(task.prompts))
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
                                   max_output_tokens=self.cfg.max_output_tokens,
                                   timeout_s=self.cfg.session_timeout_s)
            fe.write_config(paths, settings)
            env = cli_env(fe, paths, settings)
            for k, prompt in enumerate(task.prompts):
                if k and client_session is None:
                    error = "cannot resume: the first run reported no session id"
                    break
                cmd = fe.argv(exe, prompt, resume=client_session if k else None,
                                   continue_last=bool(k) and self.cfg.resume_last, workdir=str(paths.workspace))
                if cmd[-1] == prompt:  # "--": a task line such as "--version" is a prompt, never a flag
                    cmd = [*cmd[:-1], "--", prompt]
                rc, timed_out, stdout, stderr = await self._cli(self._argv(cmd, paths, sock_dir), env,
                                                                paths.workspace, deadline, paths.root / f"cli-{k}")
                parsed = fe.parse(stdout)
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
                    error = f"{fe.name} exited with code {rc}: {stderr.strip()[-300:]}"
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
            error = f"{fe.name} made no model call"
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
        trace = {**summary, "task": key, "task_id": task.task_id, "frontend": fe.name, "start_ts": t0, "end_ts": end, "e2e_s": end - t0, "error": error,
                 "cli": cli_runs, "calls": [asdict(c) for c in calls]}
        self.traces.write(json.dumps(trace, separators=(",", ":")) + "\n")
        self.results.append(trace)
        print(f"[agents] {key}: {'ok' if error is None else error[:120]} ({end - t0:.1f} s, {len(calls)} calls, "
              f"session {client_session}, workflow {','.join(wfs) or '-'})", file=sys.stderr)

    async def _check(self, task: AgentTask, paths: SessionPaths) -> tuple[bool, dict[str, Any]]:
        """Run the task's check in its workspace (in the sandbox when there is one): solved = exit 0."""
        cmd = ["bash", "-c", task.check or "false"]
        argv = bwrap_argv_plain(str(paths.workspace), cmd) if self.sandbox == "bwrap" else cmd
        proc = await asyncio.create_subprocess_exec(*argv, cwd=str(paths.workspace), env=check_env(),
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
        names = {"mars_admission_active": "active", "mars_admission_queued": "queued",
                 "mars_admission_limit": "limit", "mars_sidecar_in_flight": "in_flight"}
        # the engine's own gauges where its address is known (mars serve started for the run)
        engine = {"vllm:num_preemptions_total": "preemptions", "vllm:kv_cache_usage_perc": "kv_usage"}

        def read(text: str, wanted: dict[str, str], vals: dict[str, float]) -> None:
            for line in text.splitlines():
                name, _, v = line.partition(" ")
                key = wanted.get(name.split("{", 1)[0])
                if key is not None:
                    vals[key] = vals.get(key, 0.0) + float(v.split()[0])

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while True:
                vals: dict[str, float] = {}
                try:
                    async with s.get(self.cfg.server_root + "/metrics") as r:
                        read(await r.text(), names, vals)
                    if self.engine_url:
                        async with s.get(self.engine_url + "/metrics") as r:
                            read(await r.text(), engine, vals)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                if vals:
                    self.events.emit("kv_sample", **{k: (v if k == "kv_usage" else int(v)) for k, v in vals.items()})
                await asyncio.sleep(self.cfg.sample_interval_s)

    async def run(self) -> None:
        self.clock.start()
        self.events.emit("run_start", epoch=self.clock.epoch, monotonic_t0=self.clock.t0, policy=self.label,
                         controller=None, backend="http", workload=self.cfg.tasks, rps=self.cfg.rps,
                         arrival=self.cfg.arrival if self.cfg.rps else None, frontend=",".join(self.cfg.frontends),
                         cli=self.exes, concurrency=self.cfg.concurrency, server=self.cfg.server, model=self.model,
                         workflows=len(self.sessions), sandbox=self.sandbox, t_ideal_source=None)
        if self.sandbox_note:
            self.events.emit("sandbox_off", reason=self.sandbox_note)
        slots = asyncio.Semaphore(self.cfg.concurrency or len(self.sessions))
        sampler = asyncio.create_task(self._sampler())
        try:
            await asyncio.gather(*(self._session(s, slots) for s in self.sessions))
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            self.events.emit("run_end", sessions=len(self.results),
                             failed=sum(1 for r in self.results if r["error"]))
            self.events.close()
            self.traces.close()



def run_agents(cfg: AgentRunConfig) -> Path:
    """Run the sessions; write and return the run directory (summary.json and report.md included)."""
    cfg = replace(cfg, cpu_server=cfg.cpu_server or os.environ.get("CPU_SERVER") or None,
                  cpu_agent=cfg.cpu_agent or os.environ.get("CPU_AGENT") or None)
    cfg.validate()
    exes = {f: find_cli(get_frontend(f), cfg.agents_prefix) for f in cfg.frontends}
    tasks = load_agent_tasks(cfg.tasks)
    sessions = plan_sessions(cfg, tasks)
    sandbox, note = sandbox_mode(cfg.unsandboxed)
    if sandbox == "none":
        logger.warning("agent sessions run without a sandbox: %s", note)
    label = cfg.policy if cfg.server is None else None
    out = Path(cfg.out) if cfg.out else default_out_dir(label or f"agents-{'+'.join(cfg.frontends)}")
    out.mkdir(parents=True, exist_ok=True)
    serve = ServeProcess(cfg, out) if cfg.server is None else None
    try:
        if serve is not None:
            print(f"[agents] starting mars serve {cfg.model_path} (policy {cfg.policy}) on {serve.url}",
                  file=sys.stderr)
            serve.wait_ready()
            cfg = replace(cfg, server=serve.url)
        model = cfg.model or server_model(cfg.server_root, cfg.api_key)
        (out / "run_config.json").write_text(json.dumps({**asdict(cfg), "cli": exes, "model": model,
                                                         "sandbox": sandbox}, indent=2) + "\n")
        run = AgentRun(cfg, out, sessions, exes, model, sandbox, note, label)
        run.engine_url = serve.engine_url if serve is not None else None
        asyncio.run(run.run())
    finally:
        if serve is not None:
            serve.stop()
    summary = summarize(read_events(out))
    traces = [json.loads(x) for x in (out / "traces.jsonl").read_text().splitlines()]
    checked = [t for t in traces if t.get("solved") is not None]
    # task completion (the paper's figure 12): sessions whose task's own check passed afterwards
    summary["task_completion"] = (sum(1 for t in checked if t["solved"]) / len(checked)) if checked else None
    summary["solved"] = sum(1 for t in checked if t["solved"])
    summary["tool_calls"] = sum(t.get("tool_calls") or 0 for t in traces)
    summary["scripted"] = cfg.scripted  # the task file whose scripts the server plays (--scripted)
    summary["workload"] = {"path": "workload.jsonl", "workflows": write_workload(traces, out / "workload.jsonl")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    report = write_run_report(out, summary)
    with open(report, "a") as f:
        if summary["scripted"]:
            f.write(f"\nThe model was scripted ({summary['scripted']}): mars serve --scripted plays each task's "
                    "solution; the frontends ran the tools for real.\n")
        if summary["task_completion"] is not None:
            f.write(f"\nTask completion: {summary['solved']}/{len(checked)} sessions' checks pass afterwards.\n")
        f.write(sessions_table(traces))
    return out


def compare_agents(cfg: AgentRunConfig, policies: list[str]) -> tuple[Path, dict[str, Any]]:
    """The same session set once per policy (mars serve started for each), in ``mars compare``'s
    format: ``out/rps<R>/<policy>/`` run dirs, ``compare.json`` and ``report.md``."""
    if not policies:
        raise ValueError("--policies: name at least one policy, e.g. mars,fcfs")
    for p in policies:
        get_policy_class(p)  # an unknown name fails before any server starts
    if not cfg.model_path:
        raise ValueError("mars agents compare starts mars serve per policy: give --model-path")
    out = Path(cfg.out) if cfg.out else Path("runs") / f"agents_compare_{time.strftime('%Y%m%d_%H%M%S')}"
    rps = cfg.rps or 0.0
    cell = out / f"rps{rps:g}"
    summaries: dict[str, dict] = {}
    dirs: dict[str, str] = {}
    t0 = time.monotonic()
    for p in policies:
        run_dir = run_agents(replace(cfg, server=None, policy=p, out=str(cell / p)))
        summaries[p] = json.loads((run_dir / "summary.json").read_text())
        dirs[p] = str(run_dir)
    record = compare_record(cfg.tasks, {rps: summaries}, {rps: dirs})
    for p, s in summaries.items():  # the live runs' own columns
        d = record["cells"][0]["policies"][p]
        d["p90_e2e_s"] = (s.get("e2e_s") or {}).get("p90")
        d["task_completion"] = s.get("task_completion")
    record["config"] = {"policies": policies, "rps": [rps], "arrival": cfg.arrival, "frontends": cfg.frontends,
                        "sessions": cfg.max_requests, "num_blocks": cfg.num_blocks, "model": cfg.model_path,
                        "scripted": cfg.scripted, "cpu_server": cfg.cpu_server, "cpu_agent": cfg.cpu_agent,
                        "seed": cfg.seed}
    record["wall_s"] = time.monotonic() - t0
    write_compare_report(out, record, {rps: summaries})
    return out, record
