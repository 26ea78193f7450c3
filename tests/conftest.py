"""Shared fixtures: the tiny model, in-process engines, and a real OpenAI server on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_mars.process import free_port, stop_group, wait_http_ok

# In-process engines in tests: no spawn, 2 s start instead of 15 s (see the feasibility notes).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, check=False).returncode == 0


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: a "gpu" folder matches too
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The default tiny model dir (built once into the user cache; scripts/setup.sh prebuilds it)."""
    from vllm_mars.tiny_model import build_tiny_model

    return str(build_tiny_model())


class ServerProcess:
    """A real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on 127.0.0.1."""

    def __init__(self, model: str, log_dir: Path, port: int | None = None, env: dict | None = None,
                 **engine_kwargs):
        from vllm_mars.engine.local import server_args

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        self.sched_log = log_dir / f"sched-{self.port}.jsonl"
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                *server_args(model, port=self.port, served_model_name="tiny", cpu=True, **engine_kwargs)]
        full_env = {**os.environ, "MARS_SCHED_LOG": str(self.sched_log), **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115  (held for the process's life, closed in stop())
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 180.0) -> None:
        wait_http_ok(self.url + "/health", self.proc, timeout, what="the vLLM server",
                     detail=lambda: f":\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        stop_group(self.proc, timeout=30)
        self._log.close()


@pytest.fixture(scope="session")
def openai_server(tiny_model, tmp_path_factory):
    """One shared server for the session: MarsScheduler with the ``mars`` policy (passed the way a
    user passes it: ``--additional-config '{"mars": {"policy": "mars"}}'``), 256 blocks of 32 tokens;
    vLLM's dev-mode routes on (test_disconnect pauses the engine with ``/pause``)."""
    server = ServerProcess(tiny_model, tmp_path_factory.mktemp("server"), policy="mars", num_blocks=256,
                           max_model_len=2048, max_num_seqs=32, env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
