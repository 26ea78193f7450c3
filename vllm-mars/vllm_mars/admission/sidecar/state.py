"""The sidecar's admission state, apart from its HTTP routes (:mod:`~vllm_mars.admission.sidecar.app`):
the controller, the backends and their telemetry polling, the root lifecycle
(:class:`~vllm_mars.admission.roots.RootTable`), the bound on waiting calls, the control loop, the
event log and ``/metrics``.

Admission: the first call of a root workflow waits until the controller admits the root; later
turns and children of an admitted root pass at once (children of a waiting root wait with it).
With one backend the controller reads it and a root is placed there when admitted. With several
(``--backend`` URLs, or the data-parallel ranks of one) admission is per backend
(:meth:`SidecarState.admit_per_replica`: :class:`~vllm_mars.admission.replicas.ReplicaAdmission`,
the fleet logic the Ray gate and the cluster sim use too): a new root is placed when it arrives,
waits at its backend's own controller, which reads only that backend, and keeps that backend.
Plain calls without identity are one-call workflows. Waiting calls are bounded in number and bytes
(beyond: 503 with ``Retry-After``) and keep no parsed body (large ones are spilled to a file).
No live backend -> a new root gets 503 with ``Retry-After`` while roots already queued keep waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import deque
from typing import Any

from vllm_mars.admission.base import AdmissionController, AdmissionEvent, ControllerBase, make_controller
from vllm_mars.admission.continuity import Continuity, offers_tools
from vllm_mars.admission.identity import Identity, estimate_prompt_tokens
from vllm_mars.admission.placement import Backend, Placement, pooled_telemetry
from vllm_mars.admission.replicas import ReplicaAdmission
from vllm_mars.admission.roots import RootState, RootTable
from vllm_mars.admission.sidecar.config import SidecarConfig
from vllm_mars.admission.sidecar.held import HeldBody, QueueBudget, give_back_memory
from vllm_mars.admission.sidecar.proxy import HTTPError
from vllm_mars.admission.telemetry import TelemetryState
from vllm_mars.clock import Clock, MonotonicClock

logger = logging.getLogger(__name__)


class SidecarState:
    """What the sidecar knows and decides, with no route of its own; ``clock`` drives the root
    lifecycle. :class:`~vllm_mars.admission.sidecar.app.Sidecar` serves it over HTTP."""

    def __init__(self, config: SidecarConfig, controller: AdmissionController | None = None,
                 clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.controller = controller or make_controller(config.controller, dict(config.controller_options))
        self.backends = [Backend(u, telemetry_timeout_s=config.telemetry_timeout_s,
                                 telemetry_stale_s=config.telemetry_stale_s,
                                 connect_timeout_s=config.connect_timeout_s, clock=self.clock)
                         for u in config.backends]
        self.placement = Placement(self.backends, self.controller, config.kv_target, rule=config.placement)
        self.counters: dict[str, int] = {"requests": 0, "rejected_503": 0, "queue_full_503": 0, "upstream_errors": 0,
                                         "client_disconnects": 0, "event_write_errors": 0}
        self.lifecycle = RootTable(self.controller, self.clock, idle_timeout_s=config.idle_timeout_s,
                                   failed_idle_timeout_s=config.failed_idle_timeout_s,
                                   place=lambda r: self.placement.place(r.root, self._root_tokens.get(r.root)),
                                   on_admit=self._on_admit, on_end=self._on_end, counters=self.counters,
                                   tenant_of=(lambda root: root.partition("/")[0]) if len(set(config.keys)) > 1 else None)
        self.queue_budget = QueueBudget(config.max_queued_calls, config.max_queued_bytes)
        #: prefix continuity of generic session ids (issue 12)
        self.continuity = Continuity()
        self.in_flight = 0
        #: shutdown has begun (see :meth:`drain`)
        self.draining = False
        #: the last admission events, newest last (the full stream goes to ``events_path``)
        self.recent_events: deque[AdmissionEvent] = deque(maxlen=1000)
        self._tasks: list[asyncio.Task] = []
        self._events_file: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up_event: asyncio.Event = None  # type: ignore[assignment]  (made on the serving loop)
        self.any_up = False
        self._kv_subs: list[Any] = []
        #: a new root's prompt token ids while it waits for placement (``--kv-events`` only)
        self._root_tokens: dict[str, list[int]] = {}
        #: the per-backend admission (None: one backend, the controller reads it)
        self.admission: ReplicaAdmission | None = None

    def admit_per_replica(self) -> ReplicaAdmission:
        """Admit per backend from now on (idempotent; call before the first call): the controller
        becomes the first backend's, each other backend gets one built from its class and config, and
        roots are placed when they arrive (see the module docstring)."""
        if self.admission is None:
            first = self.controller
            cfg = self.config

            def make() -> AdmissionController:  # the same class and options as the first
                if isinstance(first, ControllerBase):
                    return type(first)(first.config)
                return make_controller(cfg.controller, dict(cfg.controller_options))

            adm = self.admission = ReplicaAdmission(self.placement, make, first=first,
                                                    prompt_of=self._root_tokens.get, clock=self.clock.now)
            self.controller = adm  # type: ignore[assignment]
            self.lifecycle.rebind(adm, lambda r: adm.backend_of(r.root))
            fw = getattr(self, "forwarder", None)
            if fw is not None:
                fw.placement = adm  # a root moved off an unreachable backend moves its admission too
        return self.admission

    @property
    def roots(self) -> dict[str, RootState]:
        return self.lifecycle.roots

    # -- lifecycle --------------------------------------------------------------------------------
    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        if cfg.events_path:
            # unbuffered: one write per batch of events, and a failed write keeps nothing behind
            self._events_file = open(cfg.events_path, "ab", buffering=0)  # noqa: SIM115, ASYNC230 (once)
        self._up_event = asyncio.Event()
        await asyncio.gather(*(b.telemetry.poll_upstream(b.pool) for b in self.placement.servers))
        self.backends = self.placement.expand_ranks()  # one backend per data-parallel rank
        if len(self.backends) > 1:
            self.admit_per_replica()
        if cfg.kv_events:
            self._kv_subs = self.placement.follow_kv_events(cfg.kv_events)
        self._observe()
        self._tasks = [asyncio.create_task(self._ticker(), name="mars-ticker")]
        self._tasks += [asyncio.create_task(self._poller(b), name=f"mars-poll-{b.url}") for b in self.placement.servers]
        logger.info("sidecar up: controller=%s backends=%s", self.controller.name, [b.name for b in self.backends])

    def drain(self) -> None:
        """Shutdown has begun: calls waiting for admission get 503 now (not a cancelled task after
        the server's grace period), and calls still in flight when that period ends are cut quietly."""
        self.draining = True
        for r in self.roots.values():
            w = r.waiter
            if w is not None and not w.done():
                w.set_exception(HTTPError(503, "sidecar shutting down; retry later", self._retry_after()))
                w.exception()  # mark retrieved

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.drain()
        for b in self.placement.servers:
            b.pool.close()
        for sub in self._kv_subs:
            sub.close()
        if self._events_file is not None:
            self._events_file.close()

    # -- control loop -----------------------------------------------------------------------------
    async def _poller(self, b: Backend) -> None:
        while True:
            await asyncio.sleep(self.config.telemetry_interval_s)
            await b.telemetry.poll_upstream(b.pool)
            self._observe()

    def _update_up(self) -> bool:
        ups = [b.refresh() for b in self.backends]  # refresh every backend, no short-circuit
        up = any(ups)
        self.any_up = self.lifecycle.live = up
        if self._up_event is not None:
            if up:
                self._up_event.set()
            else:
                self._up_event.clear()
        return up

    def _observe(self) -> None:
        """Feed the controller the live backends' reading: the one backend's, or each backend's to
        its own controller (per-backend admission; fed the sum, it takes each backend's own). None
        live: the controller sees its last reading age, which is pressure, never blind admission."""
        self._update_up()
        tel = pooled_telemetry(self.backends)
        if tel is not None:
            self.controller.observe(tel)

    def _backend_failed(self, b: Backend, msg: str) -> None:
        b.telemetry._fail(msg)  # down until its next good poll
        self._update_up()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.controller.interval_s)
            try:
                self._update_up()  # a backend whose readings stop turns stale even without a failed poll
                self.lifecycle.tick()
                self.lifecycle.expire()
                self.lifecycle.enforce_fair_shares()
                self._flush_events()
            except Exception:  # never let the control loop die
                logger.exception("admission tick failed")

    def _on_admit(self, r: RootState) -> None:
        w = r.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _on_end(self, r: RootState) -> None:
        self.placement.release(r.root, r.backend)
        w = r.waiter
        if w is not None and not w.done():
            w.cancel()
        self._flush_events()

    def _flush_events(self) -> None:
        evs = self.controller.take_events() + self.lifecycle.take_events()
        self.recent_events.extend(evs)
        if evs and self._events_file is not None:
            data = memoryview("".join([json.dumps({"ts": e.ts, "event": e.event, **e.data}, default=str) + "\n"
                                       for e in evs]).encode())
            try:  # one write per batch of events, not one per line
                while data:
                    n = self._events_file.write(data)
                    if not n:
                        raise OSError("the events file takes no more bytes")
                    data = data[n:]
            except OSError as e:  # a full disk (or /dev/full) loses events, never a call or the ticker
                self.counters["event_write_errors"] += 1
                if self.counters["event_write_errors"] == 1:
                    logger.error("cannot write admission events to %s: %s (counted in "
                                 "mars_sidecar_event_write_errors_total; logged once)", self.config.events_path, e)


    def _retry_after(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.config.retry_after_s).encode())]

    def _infer(self, ident: Identity, body: dict) -> tuple[Identity, bool, bool, int | None]:
        """Prefix continuity of a generic session id (may rename the workflow; events say why),
        and what the call is: (identity, offers tools, side call, prompt estimate)."""
        agent = offers_tools(body)
        ident, verdict = self.continuity.check(ident, body)
        ev = verdict.event()
        if ev is not None:
            self.lifecycle.emit("workflow_continuity", ev)
        side = verdict.kind == "side_call"
        est = None  # only agent calls re-estimate their root's footprint; _admit estimates new roots
        if agent and not side:
            est = ident.prefill_tokens if ident.prefill_tokens is not None else estimate_prompt_tokens(body)
        return ident, agent, side, est

    async def _admit(self, ident: Identity, call: list, est: int | None = None) -> RootState:
        """The admitted root of this call, waiting for admission if needed. ``call`` is
        ``[body, raw]``; a call that waits drops both and leaves ``[None, HeldBody]`` (its raw
        bytes, in a file when large), so a waiting call holds no parsed body."""
        lc = self.lifecycle
        r = lc.get(ident.root)
        if r is not None and r.admitted:
            r.last_activity = self.clock.now()
            return r
        if r is None:
            if not self.any_up:
                self.counters["rejected_503"] += 1
                raise HTTPError(503, "no backend is up; retry later", self._retry_after())
            if est is None:
                est = ident.prefill_tokens if ident.prefill_tokens is not None else estimate_prompt_tokens(call[0])
            r = lc.arrive(ident, est)
            if r.admitted:
                return r
        if r.waiter is None:
            r.waiter = asyncio.get_running_loop().create_future()
        r.waiters += 1
        size = 0  # (its bytes are held in the budget since it was read: see _proxy)
        if not self.queue_budget.take(size):
            lc.left_waiting(r)
            self.counters["queue_full_503"] += 1
            b = self.queue_budget
            raise HTTPError(503, f"admission queue full ({b.calls} calls, {b.bytes} bytes waiting; limits "
                                 f"{b.max_calls} calls, {b.max_bytes} bytes); retry later", self._retry_after())
        held = None
        try:
            raw = call[1]
            call[:] = [None, None]
            held = await HeldBody.hold(raw, self.config.spill_bytes, self.config.spill_dir)
            del raw
            if held.spilled and size >= 1 << 20:
                give_back_memory()
            await asyncio.shield(r.waiter)
            call[1], held = held, None
        except OSError as e:  # (the server's paths stay out of the answer)
            logger.error("cannot spill a waiting request body: %s", e)
            raise HTTPError(503, f"cannot hold the request body while it waits: {e.strerror or type(e).__name__}",
                            self._retry_after()) from None
        except asyncio.CancelledError:
            if r.waiter.cancelled():  # the workflow was ended (finish route) while this call waited
                raise HTTPError(409, f"workflow {ident.root!r} was finished while this call waited") from None
            raise
        finally:
            if held is not None:
                held.discard()
            self.queue_budget.give(size)
            lc.left_waiting(r)
        return r

    # -- observability ----------------------------------------------------------------------------
    def metrics_text(self) -> str:
        c = self.controller
        snap = c.snapshot() if hasattr(c, "snapshot") else {}
        lines = [
            "# HELP mars_admission_window Current AIMD window (active-root target).",
            "# TYPE mars_admission_window gauge",
            f"mars_admission_window {snap.get('window', -1)}",
            "# TYPE mars_admission_limit gauge",
            f"mars_admission_limit {snap.get('limit', -1)}",
            "# HELP mars_admission_active Admitted root workflows.",
            "# TYPE mars_admission_active gauge",
            f"mars_admission_active {c.num_active}",
            "# HELP mars_admission_queued Root workflows waiting for admission.",
            "# TYPE mars_admission_queued gauge",
            f"mars_admission_queued {c.num_queued}",
            "# TYPE mars_admission_admitted_total counter",
            f"mars_admission_admitted_total {getattr(c, 'num_admitted', 0)}",
            "# TYPE mars_sidecar_in_flight gauge",
            f"mars_sidecar_in_flight {self.in_flight}",
            "# HELP mars_sidecar_waiting_calls Calls waiting for admission (bounded by max_queued_calls).",
            "# TYPE mars_sidecar_waiting_calls gauge",
            f"mars_sidecar_waiting_calls {self.queue_budget.calls}",
            "# TYPE mars_sidecar_waiting_bytes gauge",
            f"mars_sidecar_waiting_bytes {self.queue_budget.bytes}",
        ]
        for k, v in self.counters.items():
            lines += [f"# TYPE mars_sidecar_{k}_total counter", f"mars_sidecar_{k}_total {v}"]
        lines += ["# TYPE mars_backend_up gauge", "# TYPE mars_backend_telemetry_age_seconds gauge",
                  "# TYPE mars_backend_free_blocks gauge", "# TYPE mars_backend_roots gauge",
                  "# TYPE mars_backend_cached_blocks gauge",
                  "# TYPE mars_backend_upstream_requests_total counter"]
        for b in self.backends:
            st = b.telemetry.status()
            lab = f'{{backend="{b.name}"}}'
            age = st.age_s if st.age_s is not None else math.inf
            lines.append(f"mars_backend_up{lab} {int(st.state is TelemetryState.OK)}")
            lines.append(f"mars_backend_telemetry_age_seconds{lab} {age:.3f}")
            fb = st.reading.free_blocks if st.reading is not None else None
            lines.append(f"mars_backend_free_blocks{lab} {fb if fb is not None else 'NaN'}")
            lines.append(f"mars_backend_roots{lab} {len(b.roots)}")
            if b.telemetry.cache is not None:
                lines.append(f"mars_backend_cached_blocks{lab} {len(b.telemetry.cache)}")
            lines.append(f"mars_backend_upstream_requests_total{lab} {b.pool.requests}")
        adm = self.admission
        if adm is not None:  # each backend's own controller
            lines += ["# HELP mars_backend_admission_active Roots admitted by this backend's controller.",
                      "# TYPE mars_backend_admission_active gauge",
                      "# HELP mars_backend_admission_queued Roots waiting at this backend's controller.",
                      "# TYPE mars_backend_admission_queued gauge"]
            for b, c in zip(adm.backends, adm.ctrls, strict=True):
                lab = f'{{backend="{b.name}"}}'
                lines.append(f"mars_backend_admission_active{lab} {c.num_active}")
                lines.append(f"mars_backend_admission_queued{lab} {c.num_queued}")
        return "\n".join(lines) + "\n"
