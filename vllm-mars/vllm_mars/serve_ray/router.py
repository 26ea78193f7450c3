"""MarsRouter: Ray Serve's ``RequestRouter`` for the vLLM replicas of :mod:`vllm_mars.serve_ray`.

Its own module because it subclasses a Ray class: importing it imports ``ray`` (the optional
``[ray]`` extra), which nothing else on the core path does (the package does not import it). Serve loads it by path
(``vllm_mars.serve_ray.router.MarsRouter``) in every process that holds a handle to the replicas.

A call goes to the replica its root is pinned to (``mars_replica``, set by the gate from the one
:class:`~vllm_mars.admission.placement.Placement`). A pinned replica that is alive but has no room
in Serve's queue is waited for (its KV is there). A call without a pin, or whose replica is gone,
goes where :meth:`Placement.score` ranks best (KV budget above the guard margin, minus blocks
promised to its roots, plus cached prefix): the same placement, never a second copy.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from ray.serve.request_router import RequestRouter

from vllm_mars.serve_ray.replica import DEPLOYMENT, replica_set


class MarsRouter(RequestRouter):
    """See the module docstring. ``set_key`` (``request_router_kwargs``) names the shared
    :class:`~vllm_mars.serve_ray.ReplicaSet` this router keeps up to date."""

    def initialize_state(self, set_key: str = DEPLOYMENT, **kwargs: Any) -> None:
        self._set = replica_set(set_key)

    def update_replicas(self, replicas: list[Any]) -> None:
        super().update_replicas(replicas)
        self._set.sync(replicas)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._set.drop(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None
                              ) -> list[list[Any]]:
        want = pending_request.kwargs.get("mars_replica") if pending_request is not None else None
        if want is not None:
            for c in candidate_replicas:
                if c.replica_id.unique_id == want:
                    return [[c]]
            if want in self._set.by_id and any(r.unique_id == want for r in self.curr_replicas):
                return []  # pinned replica alive but busy: wait for it (its KV is there)
        s = self._set
        pl = s.placement
        by_id = s.by_id
        # the gate's admission changes the promises and root sets on its own loop, and reading them
        # updates them too: score under its lock (held for a few dict reads, never across an await)
        lock = getattr(pl.controller, "lock", None)
        with lock if lock is not None else contextlib.nullcontext():
            scores = {id(c): pl.score(b) if (b := by_id.get(c.replica_id.unique_id)) is not None else -math.inf
                      for c in candidate_replicas}
        ranked = sorted(candidate_replicas, key=lambda c: -scores[id(c)])
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]
