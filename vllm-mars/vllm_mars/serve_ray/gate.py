"""The admission gate of :mod:`vllm_mars.serve_ray`: :class:`RayGate`, the sidecar whose backends are
the Serve replicas, and its :class:`RayForwarder` (a call whose replica died before the client saw
any answer is placed again)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from vllm_mars.admission.sidecar import Sidecar, SidecarConfig
from vllm_mars.admission.sidecar.proxy import Forwarder, Unreachable
from vllm_mars.clock import Clock
from vllm_mars.serve_ray.replica import STATS_PERIOD_S, ReplicaBackend, ReplicaSet

logger = logging.getLogger(__name__)


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
        by_id = self.gate.replicas.by_id
        if by_id.get(b.name) is not b:
            adm = self.gate.admission
            moved = adm.backend_of(r.root) if adm is not None else None
            if moved is None or moved is b or by_id.get(moved.name) is not moved:
                raise Unreachable(f"replica {b.name} left the deployment")
            r.backend = b = moved  # its replica's controller was retired: the root moved with it
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
    """The admission sidecar whose backends are the Serve replicas (see the package docstring).
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
        # a controller per replica, a root placed when it arrives (replicas join as Serve reports them)
        self.admit_per_replica()

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
        """Serve's replica set changed (or fresh stats came): the placement sees the live replicas, a
        new replica gets its controller, roots queued at a replica that left queue again at a live
        one, and an admitted root whose replica left is placed again at its next call (it queues at
        its new replica's controller ahead of new roots and keeps running meanwhile)."""
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
