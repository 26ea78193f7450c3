"""The replica side of :mod:`vllm_mars.serve_ray`: :class:`VLLMReplicaImpl` (the Serve deployment
running vLLM's OpenAI server as a child process) and the :class:`ReplicaSet` the router and the gate
share in one process (one :class:`ReplicaBackend` per live replica, with its routing stats as its
telemetry)."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_mars.admission.base import Telemetry
from vllm_mars.admission.placement import Placement
from vllm_mars.admission.telemetry import TelemetryState, _Reader
from vllm_mars.clock import Clock, MonotonicClock
from vllm_mars.process import stop_group

logger = logging.getLogger(__name__)


#: the Serve deployment of the vLLM replicas
DEPLOYMENT = "VLLMReplica"
#: the label the gate's config carries in place of backend URLs (for its logs and /metrics)
RAY_BACKEND_LABEL = "http://ray-serve.replicas"
#: how often each replica reports its KV reading to Ray Serve's controller (s)
STATS_PERIOD_S = 0.5


# -- replica side ---------------------------------------------------------------------------------

def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _own_group_dying_with_parent() -> None:  # pragma: no cover (runs in the child between fork and exec)
    import ctypes

    os.setsid()  # its own process group: stopping the replica stops the engine core with it
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the actor


class VLLMReplicaImpl:
    """One replica: vLLM's OpenAI server as a child process, calls passed to it (see the package
    docstring). ``engine_argv`` is the server's argument list without ``--host``/``--port``."""

    def __init__(self, engine_argv: Sequence[str], env: Mapping[str, str] | None = None,
                 startup_timeout_s: float = 600.0, log_dir: str | None = None, engine_host: str | None = None) -> None:
        import ray

        from vllm_mars.admission.telemetry import HttpTelemetry
        from vllm_mars.admission.upstream import UpstreamPool

        # the gate sends calls straight to this server: the node's address on a multi-node cluster
        # (guarded by the backend key, as `mars serve` guards its engine port), loopback on one machine
        self.host = engine_host or ray.util.get_node_ip_address()
        self.port = _free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        ctx = ray.get_runtime_context()
        self.replica_id = _current_replica_id()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", self.host,
               "--port", str(self.port), *engine_argv]
        self._log = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self._log = open(os.path.join(log_dir, f"replica-{self.port}.log"), "w")  # noqa: SIM115
        # the child dies with this actor's process (a killed replica leaves no engine behind)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                                     env={**os.environ, **(env or {})}, preexec_fn=_own_group_dying_with_parent)  # noqa: PLW1509 (setsid+prctl only)
        logger.info("replica %s (actor %s): vLLM on %s, pid %d", self.replica_id, ctx.get_actor_id(), self.url,
                    self.proc.pid)
        if log_dir:  # the engine's process group, for a stop that cannot wait for the replicas (stop(wait=False))
            with open(os.path.join(log_dir, f"replica-{self.port}.pgid"), "w") as f:
                f.write(str(self.proc.pid))
        self._wait_healthy(startup_timeout_s)
        self.telemetry = HttpTelemetry(self.url, timeout_s=5.0, stale_s=math.inf)
        self.pool = UpstreamPool(self.url, connect_timeout=5.0)
        self._seq = 0

    def _wait_healthy(self, timeout_s: float) -> None:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the replica's vLLM server exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self._stop()
        raise TimeoutError(f"the replica's vLLM server at {self.url} was not healthy within {timeout_s:.0f} s")

    # -- Serve hooks ------------------------------------------------------------------------------
    def check_health(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with code {self.proc.returncode}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """The engine's KV reading for the routers (a fresh one each period: ``seq`` changes)."""
        st = await self.telemetry.poll_upstream(self.pool)
        self._seq += 1
        out: dict[str, Any] = {"replica": self.replica_id, "url": self.url, "pid": os.getpid(),
                               "engine_pid": self.proc.pid, "seq": self._seq}
        if st.state is TelemetryState.OK and st.reading is not None:
            out["telemetry"] = st.reading.as_dict()
        else:
            out["error"] = st.error or st.state.value
        return out

    # -- calls --------------------------------------------------------------------------------------
    async def call(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]], method: str = "POST",
                   mars_replica: str | None = None) -> tuple[str, int, list[tuple[bytes, bytes]], bytes]:
        """One whole answer: (this replica's id, status, headers, body)."""
        from vllm_mars.admission.upstream import UpstreamBroken, UpstreamUnreachable

        resp = None
        try:
            resp = await self.pool.request(method, path, headers, body)
            payload = b"".join([c async for c in resp.chunks(None)])
            resp.release()
        except (UpstreamBroken, UpstreamUnreachable):
            if resp is not None:
                resp.close()
            raise
        return self.replica_id, resp.status, list(resp.headers), payload

    def _stop(self) -> None:
        stop_group(self.proc, timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __del__(self) -> None:  # Serve calls it on a graceful replica shutdown
        if getattr(self, "proc", None) is not None:
            self._stop()


def _current_replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


# -- the replica set shared by the router and the gate ---------------------------------------------

class ReplicaTelemetry(_Reader):
    """A replica's KV reading as its routing stats carry it: a reader with the same ``status()`` /
    ``budget_blocks()`` as the HTTP ones, fed by Serve's controller instead of a poll. Fresh while
    readings keep arriving within ``stale_s``."""

    def __init__(self, clock: Clock, stale_s: float) -> None:
        self.clock = clock
        self.stale_s = stale_s
        self.last: Telemetry | None = None
        self.error: str | None = None
        self._seq: Any = None

    def ingest(self, stats: Mapping[str, Any]) -> None:
        seq = stats.get("seq")
        if seq == self._seq:
            return
        self._seq = seq
        tel = stats.get("telemetry")
        if tel is None:
            self.error = str(stats.get("error", "no reading"))
            return
        self.last = Telemetry(ts=self.clock.now(), **{k: tel.get(k) for k in _TEL_FIELDS if k in tel})
        self.error = None

    def _fail(self, err: BaseException | str) -> None:
        self.error = str(err)


_TEL_FIELDS = ("free_blocks", "total_blocks", "block_size", "kv_usage", "prefix_hit_rate", "running", "waiting",
               "preemptions")


class ReplicaBackend:
    """One Serve replica as a placement target and a sidecar backend: what :class:`Placement` reads
    (``up``, ``roots``, ``telemetry``) and what the sidecar's forwarder sends through (``pool``, the
    pooled HTTP client to the replica's vLLM server). ``name`` is the Serve replica id."""

    def __init__(self, replica_id: str, url: str, clock: Clock, stale_s: float) -> None:
        from vllm_mars.admission.upstream import UpstreamPool

        self.name = replica_id
        self.url = url
        self.rank = None
        self.rank_headers: list[tuple[bytes, bytes]] = []
        self.roots: set[str] = set()
        self.up = False
        self.telemetry = ReplicaTelemetry(clock, stale_s)
        self.pool = UpstreamPool(url)
        self.stats: dict[str, Any] = {}

    def refresh(self) -> bool:
        self.up = self.telemetry.status().state is TelemetryState.OK
        return self.up

    def __repr__(self) -> str:
        return f"ReplicaBackend({self.name!r}, {self.url}, up={self.up}, roots={len(self.roots)})"


class ReplicaSet:
    """The live replicas of one deployment as backends, updated by :class:`MarsRouter` (on Serve's
    router loop) and read by the gate (on its own loop): the router swaps whole lists, the gate's
    ``on_change`` runs on the gate's loop."""

    def __init__(self, clock: Clock | None = None, stale_s: float = 10 * STATS_PERIOD_S) -> None:
        self.clock = clock or MonotonicClock()
        self.stale_s = stale_s
        self.by_id: dict[str, ReplicaBackend] = {}
        self.backends: list[ReplicaBackend] = []
        #: a Placement for calls that come without a gate (scores only; controller-less)
        self.placement = Placement([], None)
        self.on_change: Any = None
        self._lock = threading.Lock()

    def sync(self, replicas: Sequence[Any]) -> None:
        """Make the set the given Serve replicas (``RunningReplica`` s), with their latest stats."""
        with self._lock:
            by_id = {}
            for rep in replicas:
                rid = rep.replica_id.unique_id
                stats = rep.routing_stats or {}
                b = self.by_id.get(rid)
                if b is None:
                    if not stats.get("url"):
                        continue  # no report yet: not a target until its first reading
                    b = ReplicaBackend(rid, stats["url"], self.clock, self.stale_s)
                b.stats = dict(stats)
                b.telemetry.ingest(stats)
                b.refresh()
                by_id[rid] = b
            changed = by_id.keys() != self.by_id.keys()
            self.by_id = by_id
            self.backends = list(by_id.values())
            self.placement.backends = self.backends
        cb = self.on_change
        if cb is not None:
            cb(changed)

    def drop(self, replica_id: str) -> None:
        with self._lock:
            b = self.by_id.pop(replica_id, None)
            if b is None:
                return
            b.telemetry._fail("replica died")
            b.refresh()
            self.backends = list(self.by_id.values())
            self.placement.backends = self.backends
        cb = self.on_change
        if cb is not None:
            cb(True)


#: one ReplicaSet per (app, deployment) in this process: the router and the gate meet here
_SETS: dict[str, ReplicaSet] = {}
_SETS_LOCK = threading.Lock()


def replica_set(key: str) -> ReplicaSet:
    with _SETS_LOCK:
        s = _SETS.get(key)
        if s is None:
            s = _SETS[key] = ReplicaSet()
        return s
