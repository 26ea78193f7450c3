"""What ``mars agents run`` reads (:class:`AgentRunConfig`, flags 1:1) and the session plan it makes
from the tasks (:func:`plan_sessions`)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mars.agents.frontends import get_frontend
from vllm_mars.agents.tasks import AgentTask
from vllm_mars.driver.arrivals import arrival_times


@dataclass
class AgentRunConfig:
    """Everything ``mars agents run`` reads (flags map 1:1)."""

    #: one frontend, or a comma list: a mix (session i uses the (i mod n)-th)
    frontend: str
    tasks: str
    #: the server's base URL (``mars serve`` / the sidecar, or any OpenAI-compatible server); None:
    #: ``mars serve --model-path ...`` is started for the run (and stopped after it)
    server: str | None = None
    #: sessions at once (None: as many as there are; with --rps, open-loop arrivals)
    concurrency: int | None = 1
    #: open-loop session arrivals per second (None: all at the start)
    rps: float | None = None
    #: ``fixed`` (i / rps) or ``poisson``
    arrival: str = "fixed"
    #: sessions in all (tasks are reused in order; default: one per task)
    max_requests: int | None = None
    seed: int = 0
    #: when ``server`` is None: the model ``mars serve`` serves, its policy, KV blocks, scripted task
    #: file and extra ``mars serve`` arguments
    model_path: str | None = None
    policy: str = "mars"
    num_blocks: int | None = None
    scripted: str | None = None
    serve_args: tuple[str, ...] = ()
    #: cores for the started server and for the agents (``taskset -c`` lists; default $CPU_SERVER, $CPU_AGENT)
    cpu_server: str | None = None
    cpu_agent: str | None = None
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

    @property
    def frontends(self) -> list[str]:
        return [f.strip() for f in self.frontend.split(",") if f.strip()]

    def validate(self) -> None:
        if not self.frontends:
            raise ValueError("--frontend: name one of codex, opencode, openhands (or a comma list)")
        for f in self.frontends:
            get_frontend(f)
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.session_timeout_s <= 0:
            raise ValueError(f"--session-timeout must be > 0, got {self.session_timeout_s}")
        if self.server is None and not self.model_path:
            raise ValueError("give --server URL (a running server) or --model-path MODEL (mars serve is started)")
        if self.server is not None and not self.server.startswith(("http://", "https://")):
            raise ValueError(f"--server {self.server!r} must start with http:// or https://")
        if self.rps is not None and not self.rps > 0:
            raise ValueError(f"--rps must be > 0, got {self.rps}")
        if self.arrival not in ("fixed", "poisson"):
            raise ValueError(f"--arrival {self.arrival!r} unknown; allowed: fixed, poisson")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.context_window < 1 or (self.max_output_tokens is not None and self.max_output_tokens < 1):
            raise ValueError("--context-window and --max-output-tokens must be >= 1")

    @property
    def server_root(self) -> str:
        """The server URL without a trailing /v1."""
        s = (self.server or "").rstrip("/")
        return s.removesuffix("/v1")


@dataclass(frozen=True)
class Session:
    """One planned session: its workflow key, task, frontend and arrival offset (s)."""

    key: str
    task: AgentTask
    frontend: str
    offset: float = 0.0


def plan_sessions(cfg: AgentRunConfig, tasks: list[AgentTask]) -> list[Session]:
    """``max_requests`` sessions (default: one per task): session i runs task i mod len(tasks) with
    frontend i mod len(frontends), arriving at the i-th offset of the arrival process."""
    fes = cfg.frontends
    n = cfg.max_requests or len(tasks)
    offsets = arrival_times(n, process=cfg.arrival, rps=cfg.rps, seed=cfg.seed) if cfg.rps else [0.0] * n
    plain = n == len(tasks) and len(fes) == 1
    return [Session(tasks[i % len(tasks)].task_id if plain else f"{i:03d}-{fes[i % len(fes)]}-"
                    f"{tasks[i % len(tasks)].task_id}", tasks[i % len(tasks)], fes[i % len(fes)], offsets[i])
            for i in range(n)]
