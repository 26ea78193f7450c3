"""A cluster in virtual time: ``--backend sim --replicas N`` runs N simulated engines behind the one
placement, on one virtual clock.

:class:`SimCluster` implements the driver's ``Backend`` protocol over N :class:`SimBackend`
engines (each unchanged: its own scheduler, KV pool and step loop, all coroutines on the same
virtual-time loop, so the replicas step concurrently in virtual time as GPUs would). It is the
sidecar's arrangement with the HTTP hop taken out:

* one admission controller (the run's, ``Replay.ctrl``) sees the replicas' readings summed by
  :func:`~vllm_mars.admission.placement.pooled_telemetry`, as the sidecar's does;
* a new root goes where :class:`~vllm_mars.admission.placement.Placement` (the sidecar's own
  class, with the run's ``--placement`` rule) puts it, on its first call; its later turns and its
  children stay on that replica; the root is released when the driver ends it (``end_root``,
  as the sidecar's root table releases it);
* each replica's reader is exact and always fresh (the sim reads its scheduler at this virtual
  instant), and its ``cache`` answers the ``mars`` rule's prefix term from the replica's own prefix
  cache (as ``--kv-events`` does for a real server).

A call without a root (none in a replay; the calibration runs on an engine of its own) is a
one-call workflow: placed, then released when it ends.

With one replica the cluster is transparent: the same engine sees the same calls at the same
virtual instants, so the run's events and summary are byte-identical to the plain sim backend's
(tests/test_sim_cluster.py). With more, ``engine_stats`` sums the replicas' counters and adds
``cluster``: the rule, each replica's roots, busy seconds and time-mean KV usage, and the
placement imbalance (max / mean over replicas of each of those loads).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_mars.admission.placement import Placement, check_placement, pooled_telemetry
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
        self._home: dict[str, SimReplica] = {}
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

    def bind_controller(self, controller: Any) -> None:
        """Place by ``controller``'s state (its ``kv_target``, the blocks it promised to roots not yet
        visible in a replica's reading), as the sidecar's Placement does with its controller."""
        self.placement = Placement(self.replicas, controller, rule=self.rule)

    def set_cost_model(self, cost: Any) -> None:
        for e in self.engines:
            e.scheduler.set_cost_model(cost)

    # -- placement ----------------------------------------------------------------------------------
    def _place(self, root: str, tokens: Sequence[int]) -> SimReplica:
        if self.placement is None:
            self.bind_controller(None)
        r = self.placement.place(root, tokens)
        r.placed += 1
        return r  # type: ignore[return-value]

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
            for r in self.replicas:
                t = r.telemetry.last
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
