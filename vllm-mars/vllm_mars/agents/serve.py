"""The server side of an agent run: the model a running server lists, and ``mars serve`` started for
a run that names no ``--server``."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from vllm_mars.agents.config import AgentRunConfig
from vllm_mars.process import free_port, stop_group, wait_http_ok


def server_model(server_root: str, api_key: str | None) -> str:
    """The first model the server lists (GET /v1/models)."""
    req = urllib.request.Request(server_root + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())
        return str(data["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--server {server_root}: cannot list its models ({e}); is it up? (or pass --model)") from None


class ServeProcess:
    """``mars serve`` started for a run (no ``--server``): the run's policy, KV blocks and scripted
    task file, pinned to ``cpu_server``; its log and admission events in the run dir."""

    def __init__(self, cfg: AgentRunConfig, out: Path) -> None:
        self.port, engine_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_url = f"http://127.0.0.1:{engine_port}"
        cmd = [sys.executable, "-m", "vllm_mars.cli", "serve", str(cfg.model_path), "--port", str(self.port),
               "--engine-port", str(engine_port), "--policy", cfg.policy, "--events", str(out / "admission.jsonl"),
               "--engine-log", str(out / "engine.log"), "--default-max-tokens", "512"]
        if cfg.model:
            cmd += ["--served-model-name", cfg.model]
        if cfg.num_blocks is not None:
            cmd += ["--num-blocks", str(cfg.num_blocks)]
        if cfg.scripted:
            cmd += ["--scripted", cfg.scripted]
        cmd += list(cfg.serve_args)
        if cfg.cpu_server:
            cmd = ["taskset", "-c", cfg.cpu_server, *cmd]
        (out / "serve_command.txt").write_text(" ".join(cmd) + "\n")
        self._log = open(out / "serve.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 900.0) -> None:
        wait_http_ok(self.url + "/v1/models", self.proc, timeout, what="mars serve", interval_s=1.0,
                     detail=lambda: f": see {self._log.name}")

    def stop(self) -> None:
        stop_group(self.proc, timeout=60)
        self._log.close()
