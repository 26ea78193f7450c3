"""The real agent CLIs as non-interactive sessions: their config, command line and JSON output.

Each session gets its own directory: ``workspace/`` (the CLI's working directory, the task's files)
and ``home/`` (``HOME``, the XDG dirs and ``CODEX_HOME``: the CLI's config and its session store,
which ``resume``/``--session`` read). Nothing is read from the user's own config. The configs point
the CLI at ``base_url`` (the runner's per-session proxy in front of the server) and switch off
what would reach the internet: update checks, model catalogue fetches, sharing, telemetry,
plugin/LSP downloads. docs/frontends.md shows the same configs for a user's own machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SessionPaths:
    """One session's directories (``root`` is all the sandbox lets it write)."""

    root: Path

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def make(self) -> SessionPaths:
        for d in (self.workspace, self.home):
            d.mkdir(parents=True, exist_ok=True)
        return self


@dataclass(frozen=True)
class CliSettings:
    """What every session's config says."""

    #: the OpenAI-compatible base URL the CLI calls, ending in /v1
    base_url: str
    #: the served model name
    model: str
    api_key: str = "mars"
    context_window: int = 32768
    #: OpenCode: the output limit it sends as max_tokens (Codex sends none; cap it on the server)
    max_output_tokens: int | None = None
    #: OpenHands: the per-call HTTP timeout (the session's timeout; the SDK's own default is 300 s)
    timeout_s: float = 3600.0


@dataclass
class SessionOutput:
    """What one CLI run printed, parsed from its JSON event stream."""

    session_id: str | None = None
    final_text: str | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    #: model steps the CLI reports (Codex: turns; OpenCode: steps = agent-loop calls)
    steps: int = 0
    #: tools the CLI ran (Codex: command_execution / file_change items; OpenCode: tool_use parts)
    tool_calls: int = 0
    errors: list[str] = field(default_factory=list)
    #: lines that were not JSON (CLI warnings)
    other_lines: int = 0


def _events(stdout: str, out: SessionOutput) -> list[dict[str, Any]]:
    evs = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            out.other_lines += 1
            continue
        if isinstance(e, dict):
            evs.append(e)
    return evs


class Frontend:
    """An agent CLI: ``write_config``, ``env``, ``argv`` and ``parse``."""

    name: str = ""
    #: the executable's name in the npm prefix's ``node_modules/.bin``
    binary: str = ""
    #: the session headers it sends (for the docs and the report)
    identity_headers: tuple[str, ...] = ()

    def executable(self, root: Path) -> Path:
        """Where the installer puts it under the agents prefix ``root``."""
        return root / "node_modules" / ".bin" / self.binary

    def write_config(self, paths: SessionPaths, s: CliSettings) -> None:
        raise NotImplementedError

    def env(self, paths: SessionPaths, s: CliSettings) -> dict[str, str]:
        home = str(paths.home)
        return {"HOME": home, "XDG_CONFIG_HOME": f"{home}/.config", "XDG_DATA_HOME": f"{home}/.local/share",
                "XDG_CACHE_HOME": f"{home}/.cache", "XDG_STATE_HOME": f"{home}/.local/state",
                "NO_COLOR": "1", "TERM": "dumb"}

    def argv(self, exe: str, prompt: str, resume: str | None = None, continue_last: bool = False,
             workdir: str | None = None) -> list[str]:
        raise NotImplementedError

    def parse(self, stdout: str) -> SessionOutput:
        raise NotImplementedError


class Codex(Frontend):
    """OpenAI Codex CLI (npm ``@openai/codex``): ``codex exec --json``, Responses API only."""

    name = "codex"
    binary = "codex"
    identity_headers = ("session_id", "session-id", "thread-id", "x-codex-parent-thread-id")

    def config_toml(self, s: CliSettings) -> str:
        return "\n".join([
            f"model = {json.dumps(s.model)}",
            'model_provider = "mars"',
            f"model_context_window = {int(s.context_window)}",
            'approval_policy = "never"',
            # the runner's bubblewrap sandbox is the boundary; Codex's own would nest a second one
            'sandbox_mode = "danger-full-access"',
            "check_for_update_on_startup = false",
            "",
            "[model_providers.mars]",
            'name = "vllm-mars"',
            f"base_url = {json.dumps(s.base_url)}",
            'env_key = "MARS_API_KEY"',
            'wire_api = "responses"',
            "request_max_retries = 0",
            "stream_max_retries = 0",
            "",
            "[analytics]",
            "enabled = false",
            "",
            "[feedback]",
            "enabled = false",
            "",
        ])

    def write_config(self, paths: SessionPaths, s: CliSettings) -> None:
        d = paths.home / ".codex"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.toml").write_text(self.config_toml(s))

    def env(self, paths: SessionPaths, s: CliSettings) -> dict[str, str]:
        return {**super().env(paths, s), "CODEX_HOME": str(paths.home / ".codex"), "MARS_API_KEY": s.api_key}

    def argv(self, exe: str, prompt: str, resume: str | None = None, continue_last: bool = False,
             workdir: str | None = None) -> list[str]:
        head = [exe, "exec", "--skip-git-repo-check", "--json"]
        if continue_last:
            return [*head, "resume", "--last", prompt]
        if resume is not None:
            return [*head, "resume", resume, prompt]
        return [*head, prompt]

    def parse(self, stdout: str) -> SessionOutput:
        out = SessionOutput()
        for e in _events(stdout, out):
            t = e.get("type")
            if t == "thread.started":
                out.session_id = e.get("thread_id")
            elif t == "turn.completed":
                u = e.get("usage") or {}
                out.steps += 1
                out.input_tokens += int(u.get("input_tokens") or 0)
                out.cached_tokens += int(u.get("cached_input_tokens") or 0)
                out.output_tokens += int(u.get("output_tokens") or 0)
            elif t == "item.completed":
                item = e.get("item") or {}
                if item.get("type") == "agent_message":
                    out.final_text = item.get("text")
                elif item.get("type") in ("command_execution", "file_change", "mcp_tool_call"):
                    out.tool_calls += 1
                elif item.get("type") == "error":
                    out.errors.append(str(item.get("message"))[:300])
            elif t in ("turn.failed", "error"):
                err = e.get("error") or e.get("message") or e
                out.errors.append(json.dumps(err)[:300] if not isinstance(err, str) else err[:300])
        return out


class OpenCode(Frontend):
    """OpenCode (npm ``opencode-ai``): ``opencode run --format json``, chat completions through
    ``@ai-sdk/openai-compatible`` (bundled in the binary: nothing is installed at run time)."""

    name = "opencode"
    binary = "opencode"
    identity_headers = ("x-session-id", "x-session-affinity", "x-parent-session-id")

    def config(self, s: CliSettings) -> dict[str, Any]:
        # OpenCode requires limit.output (it sends it as max_tokens)
        out = s.max_output_tokens if s.max_output_tokens is not None else min(8192, s.context_window // 2)
        limit = {"context": int(s.context_window), "output": int(out)}
        return {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"mars": {
                "npm": "@ai-sdk/openai-compatible", "name": "vllm-mars",
                "options": {"baseURL": s.base_url, "apiKey": s.api_key},
                "models": {s.model: {"name": s.model, "tool_call": True, "limit": limit}}}},
            "model": f"mars/{s.model}",
            # title generation and other side calls go to the same server (else: a hosted model)
            "small_model": f"mars/{s.model}",
            "autoupdate": False,
            "share": "disabled",
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        }

    def write_config(self, paths: SessionPaths, s: CliSettings) -> None:
        (paths.home / "opencode.json").write_text(json.dumps(self.config(s), indent=2) + "\n")

    def env(self, paths: SessionPaths, s: CliSettings) -> dict[str, str]:
        off = ("AUTOUPDATE", "MODELS_FETCH", "LSP_DOWNLOAD", "DEFAULT_PLUGINS", "SHARE", "CLAUDE_CODE",
               "EXTERNAL_SKILLS")
        return {**super().env(paths, s), "OPENCODE_CONFIG": str(paths.home / "opencode.json"),
                **{f"OPENCODE_DISABLE_{k}": "1" for k in off}}

    def argv(self, exe: str, prompt: str, resume: str | None = None, continue_last: bool = False,
             workdir: str | None = None) -> list[str]:
        # --dir: without it a session's directory (its tools' cwd) became the workspace's parent
        head = [exe, "run", "--format", "json", *(("--dir", workdir) if workdir else ())]
        if continue_last:
            return [*head, "--continue", prompt]
        if resume is not None:
            return [*head, "--session", resume, prompt]
        return [*head, prompt]

    def parse(self, stdout: str) -> SessionOutput:
        out = SessionOutput()
        texts: list[str] = []
        for e in _events(stdout, out):
            out.session_id = out.session_id or e.get("sessionID")
            part = e.get("part") or {}
            t = e.get("type")
            if t == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif t == "tool_use":
                out.tool_calls += 1
            elif t == "step_finish":
                tok = part.get("tokens") or {}
                out.steps += 1
                out.input_tokens += int(tok.get("input") or 0)
                out.cached_tokens += int((tok.get("cache") or {}).get("read") or 0)
                out.output_tokens += int(tok.get("output") or 0)
            elif t == "error":
                err = e.get("error") or e
                out.errors.append(json.dumps(err)[:300])
        out.final_text = texts[-1] if texts else None
        return out


class OpenHands(Frontend):
    """The OpenHands SDK (PyPI ``openhands-sdk`` + ``openhands-tools``): one conversation per session,
    run by ``_openhands_exec.py`` with the Python of its own venv (``PREFIX/openhands``: it needs
    Python >= 3.12 and ``mcp<2``, vLLM ``mcp>=2``). Terminal and file-editor tools, native tool calling
    through litellm (``openai/<model>`` at ``base_url``), which sends ``x-litellm-session-id`` and
    ``prompt_cache_key`` = the conversation id; the conversation ends with the agent's ``finish``."""

    name = "openhands"
    binary = "python"
    identity_headers = ("x-litellm-session-id",)
    script = str(Path(__file__).with_name("_openhands_exec.py"))

    def executable(self, root: Path) -> Path:
        return root / "openhands" / "bin" / "python"

    def write_config(self, paths: SessionPaths, s: CliSettings) -> None:
        cfg = {"base_url": s.base_url, "model": s.model, "api_key": s.api_key,
               "max_output_tokens": s.max_output_tokens, "max_iterations": 30, "timeout_s": s.timeout_s,
               "persistence_dir": str(paths.home / "conversations")}
        (paths.home / "openhands.json").write_text(json.dumps(cfg, indent=2) + "\n")

    def argv(self, exe: str, prompt: str, resume: str | None = None, continue_last: bool = False,
             workdir: str | None = None) -> list[str]:
        root = str(Path(workdir).parent / "home") if workdir else "home"
        # file_editor takes absolute paths: the prompt says where the workspace is, as a user would
        text = f"{prompt}\n\nThe workspace is {workdir}." if workdir else prompt
        return [exe, "-I", self.script, "--config", f"{root}/openhands.json", "--workspace", workdir or ".",
                *(("--resume", resume) if resume else ()), text]

    def parse(self, stdout: str) -> SessionOutput:
        out = SessionOutput()
        for e in _events(stdout, out):
            t = e.get("type")
            if t == "conversation":
                out.session_id = e.get("id")
            elif t == "action":
                out.steps += 1
                out.tool_calls += 1
            elif t == "message":
                out.final_text = e.get("text")
            elif t == "usage":
                out.input_tokens += int(e.get("input_tokens") or 0)
                out.cached_tokens += int(e.get("cached_tokens") or 0)
                out.output_tokens += int(e.get("output_tokens") or 0)
            elif t == "error":
                out.errors.append(str(e.get("message"))[:300])
            elif t == "done" and e.get("status") != "finished":
                out.errors.append(f"conversation ended {e.get('status')}")
        return out


FRONTENDS: dict[str, Frontend] = {f.name: f for f in (Codex(), OpenCode(), OpenHands())}


def get_frontend(name: str) -> Frontend:
    try:
        return FRONTENDS[name]
    except KeyError:
        raise ValueError(f"--frontend {name!r} unknown; allowed: {', '.join(FRONTENDS)}") from None
