"""A cluster in virtual time: ``--backend sim --replicas N`` runs N simulated engines behind the one
placement, each with its own admission controller, on one virtual clock.

:class:`SimCluster` implements the driver's ``Backend`` protocol over N :class:`SimBackend`
engines (each unchanged: its own scheduler, KV pool and step loop, all coroutines on the same
virtual-time loop, so the replicas step concurrently in virtual time as GPUs would). It is a fleet
sharded as a real one is (a gate per replica, roots placed before they are admitted), with the HTTP
hop taken out:

* a new root is placed when it arrives, by
  :class:`~vllm_mars.admission.placement.Placement` (the sidecar's own class, with the run's
  ``--placement`` rule), and waits for admission at its replica; its turns and children stay on
  that replica; the root is released when the driver ends it (``end_root``);
* each replica has its own admission controller, by the fleet's one placement + admission logic
  (:class:`~vllm_mars.admission.replicas.ReplicaAdmission`, which the sidecar and the Ray gate use
  too: the run's controller for replica 0, one more built from the same policy and options for each
  other replica), which sees only its replica's reading, so its window and KV budget are that
  replica's. The ``mars`` rule scores a replica's budget net of the blocks its controller has
  promised to admitted roots and of the footprints of the roots waiting at it;
* each replica's reader is exact and always fresh (the sim reads its scheduler at this virtual
  instant), and its ``cache`` answers the ``mars`` rule's prefix term from the replica's own prefix
  cache (as ``--kv-events`` does for a real server).

One controller over the replicas' summed reading under-admits at scale
(experiments/scale_out/README.md); no path uses that shape any more.

A call without a root (none in a replay; the calibration runs on an engine of its own) is a
one-call workflow: placed, then released when it ends.

With one replica the cluster is transparent: the run's controller and the same engine see the same
calls at the same virtual instants, so the run's events and summary are byte-identical to the plain
sim backend's (tests/test_sim_cluster.py). With more, ``engine_stats`` sums the replicas' counters
and adds ``cluster``: the rule, the admission shape, each replica's roots, busy seconds and
time-mean KV usage, and the placement imbalance (max / mean over replicas of each of those loads).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from vllm_mars.admission.base import Telemetry
from vllm_mars.admission.placement import Placement, check_placement, pooled_telemetry
from vllm_mars.admission.replicas import ReplicaAdmission
from vllm_mars.admission.telemetry import _Reader
from vllm_mars.backend import CallResult


class _Now:
    """The ``Clock`` protocol over the run clock (a callable)."""

    __slots__ = ("now",)

    def __init__(self, clock: Any) -> None:
        self.now = clock


class _Prefix:
    """A replica's prefix cache as Placement's ``cache`` (``prefix_blocks(tokens)``); the prompt's
    block hashes are computed once per placement and shared by every replica's view."""

    __slots__ = ("engine", "memo")

    def __init__(self, engine: Any, memo: list) -> None:
        self.engine = engine
        self.memo = memo  # [tokens, hashes] of the last prompt asked about

    def prefix_blocks(self, tokens: Sequence[int]) -> int:
        from vllm_mars.engine.rig import cached_prefix_blocks, prompt_block_hashes

        memo = self.memo
        if memo[0] is not tokens:
            memo[0], memo[1] = tokens, prompt_block_hashes(tokens, self.engine.profile.block_size)
        return cached_prefix_blocks(self.engine.scheduler, memo[1])


class _ReplicaReader(_Reader):
    """A replica's reading, read from its scheduler whenever asked (never stale, never failed)."""

    error = None
    stale_s = math.inf

    def __init__(self, engine: Any, clock: Any) -> None:
        self.engine = engine
        self.clock = _Now(clock)
        self.cache = None

    @property
    def last(self):  # type: ignore[override]
        return self.engine.sample()


class SimReplica:
    """One simulated engine as a placement target (what Placement reads of a backend)."""

    __slots__ = ("engine", "index", "kv_area", "kv_ts", "name", "placed", "roots", "telemetry", "up")

    def __init__(self, index: int, engine: Any, clock: Any) -> None:
        self.index = index
        self.name = f"sim#{index}"
        self.engine = engine
        self.roots: set[str] = set()
        self.up = True
        self.telemetry = _ReplicaReader(engine, clock)
        #: roots placed here over the run
        self.placed = 0
        #: time integral of KV usage (usage x seconds) since the run started, and its last instant
        self.kv_area = 0.0
        self.kv_ts: float | None = None

    def refresh(self) -> bool:
        return self.up


class SimCluster:
    """The driver's Backend over N sim engines and one Placement (see the module docstring)."""

    name = "sim"

    def __init__(self, engines: Sequence[Any], clock: Any, *, rule: str = "mars") -> None:
        if not engines:
            raise ValueError("a sim cluster needs at least one replica")
        self.rule = check_placement(rule)
        self.engines = list(engines)
        self.clock = clock
        self.replicas = [SimReplica(i, e, clock) for i, e in enumerate(self.engines)]
        self.placement: Placement | None = None
        #: the per-replica admission (None: the run's controller is fed as is; one replica)
        self.admission: ReplicaAdmission | None = None
        self._home: dict[str, SimReplica] = {}
        self._taken: list[Telemetry] | None = None
        self.vocab_size: int | None = None
        self.cost_model: Any = None

    # -- wiring -------------------------------------------------------------------------------------
    async def start(self) -> None:
        for e in self.engines:
            await e.start()
        self.vocab_size = self.engines[0].vocab_size
        self.cost_model = self.engines[0].cost_model
        memo: list = [None, None]
        for r in self.replicas:
            r.telemetry.cache = _Prefix(r.engine, memo)

    def bind_controller(self, controller: Any, make: Callable[[], Any] | None = None,
                        prompt_of: Callable[[str], Sequence[int] | None] | None = None) -> Any:
        """The controller the driver feeds. One replica (or no ``make``): ``controller`` itself, and
        roots are placed at their first call by its promises. More: a :class:`ReplicaAdmission` over
        ``controller`` (replica 0's) and ``make()`` for each other replica; roots are placed when
        offered (``prompt_of(root)``: its first prompt, for the ``mars`` rule's prefix term)."""
        self.placement = Placement(self.replicas, controller, rule=self.rule)
        if make is None or len(self.replicas) == 1:
            return controller
        self.admission = ReplicaAdmission(self.placement, make, first=controller, prompt_of=prompt_of,
                                          place=self.place_root, readings=self._readings_for,
                                          label=lambda r: r.index, lazy=True)
        return self.admission

    def set_cost_model(self, cost: Any) -> None:
        for e in self.engines:
            e.scheduler.set_cost_model(cost)

    # -- placement ----------------------------------------------------------------------------------
    def _place(self, root: str, tokens: Sequence[int] | None) -> SimReplica:
        if self.placement is None:
            self.bind_controller(None)
        r = self.placement.place(root, tokens)
        r.placed += 1
        return r  # type: ignore[return-value]

    def place_root(self, root: str, tokens: Sequence[int] | None = None) -> SimReplica:
        """Place new root ``root`` now (before its admission); its calls go to that replica."""
        r = self._home[root] = self._place(root, tokens)
        return r

    def readings(self) -> list[Telemetry]:
        """Each replica's reading now: the ones the last :meth:`sample` took, once (the driver
        observes right after it samples, with no step between), else fresh ones."""
        taken, self._taken = self._taken, None
        return taken if taken is not None else [r.telemetry.last for r in self.replicas]

    def _readings_for(self, replicas: Sequence[SimReplica], fed: Telemetry) -> list[Telemetry]:
        """Each replica's reading (:meth:`readings`) with the driver's fields of the reading it
        feeds (clock, prefix hit rate, tool plane)."""
        return [replace(r, ts=fed.ts, prefix_hit_rate=fed.prefix_hit_rate, tools_in_flight=fed.tools_in_flight,
                        tool_workers=fed.tool_workers, tool_queue_wait_s=fed.tool_queue_wait_s)
                for r in self.readings()]

    def end_root(self, root: str) -> None:
        """The driver ended root ``root``: its replica no longer carries it."""
        r = self._home.pop(root, None)
        if r is not None:
            Placement.release(root, r)  # type: ignore[arg-type]

    # -- Backend protocol ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                       extra_args: Mapping[str, Any], ignore_eos: bool = True) -> CallResult:
        root = extra_args.get("mars_root")
        if isinstance(root, str):
            r = self._home.get(root)
            if r is None:
                r = self._home[root] = self._place(root, prompt_ids)
            return await r.engine.generate(request_id, prompt_ids, max_tokens, extra_args, ignore_eos)
        r = self._place(request_id, prompt_ids)  # a one-call workflow
        try:
            return await r.engine.generate(request_id, prompt_ids, max_tokens, extra_args, ignore_eos)
        finally:
            Placement.release(request_id, r)  # type: ignore[arg-type]

    async def abort(self, request_id: str) -> None:
        """The engines abort a call whose caller is cancelled (``SimBackend.generate``); nothing else
        to do here."""

    def sample(self):
        """The replicas' readings summed (the sidecar's pooled view); also integrates each replica's
        KV usage over time for the imbalance figures."""
        if len(self.replicas) > 1:
            now = self.clock()
            self._taken = [r.telemetry.last for r in self.replicas]
            for r, t in zip(self.replicas, self._taken, strict=True):
                if r.kv_ts is not None and t.kv_usage is not None:
                    r.kv_area += t.kv_usage * (now - r.kv_ts)
                r.kv_ts = now
        return pooled_telemetry(self.replicas)  # type: ignore[arg-type]

    def engine_stats(self) -> dict[str, Any]:
        if len(self.engines) == 1:
            return self.engines[0].engine_stats()
        per = [e.engine_stats() for e in self.engines]
        out: dict[str, Any] = {}
        for k in per[0]:
            vals = [p.get(k) for p in per]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
                out[k] = round(sum(vals), 6) if any(isinstance(v, float) for v in vals) else sum(vals)
            elif all(v == vals[0] for v in vals):
                out[k] = vals[0]
            else:
                out[k] = next((v for v in vals if v not in (None, "ok")), vals[0]) if k == "leak_check" else vals
        out["cluster"] = self.cluster_stats(per)
        return out

    def cluster_stats(self, per: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Per replica: roots placed, busy virtual seconds, time-mean KV usage; and the placement
        imbalance of each (max / mean over replicas; 1.0 = even)."""
        per = per if per is not None else [e.engine_stats() for e in self.engines]
        span = max((r.kv_ts or 0.0) for r in self.replicas)
        rows = [{"replica": r.name, "roots": r.placed, "busy_s": p.get("busy_s"),
                 "kv_mean": round(r.kv_area / span, 6) if span > 0 else None,
                 "recomputed_tokens": p.get("recomputed_tokens"), "preemptions": p.get("preemptions")}
                for r, p in zip(self.replicas, per, strict=True)]

        def imbalance(key: str) -> float | None:
            vals = [row[key] for row in rows]
            if any(v is None for v in vals) or not sum(vals):
                return None
            return round(max(vals) / (sum(vals) / len(vals)), 4)

        return {"replicas": len(rows), "placement": self.rule,
                "admission": "per-replica" if self.admission is not None else "one",
                "imbalance": {"roots": imbalance("roots"), "busy_s": imbalance("busy_s"),
                              "kv_mean": imbalance("kv_mean")},
                "per_replica": rows}

    async def close(self) -> None:
        """Close every engine (each runs its leak check); the first failure is raised after all closed."""
        first: BaseException | None = None
        for e in self.engines:
            try:
                await e.close()
            except Exception as ex:  # noqa: BLE001 - every engine is closed before it is raised
                first = first or ex
        if first is not None:
            raise first
