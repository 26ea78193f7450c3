"""Backends behind the sidecar and where a new root goes.

A :class:`Backend` is one placement target: a vLLM server, or one data-parallel rank of a server
that runs several (:meth:`Placement.expand_ranks` splits a server by the ``engine`` labels on its
/metrics; each rank then has its own reading, and every call of a root placed on it carries vLLM's
``X-data-parallel-rank`` header, so vLLM's internal load balancer cannot move the root's turns to
a rank without its KV). A backend holds its reader, its server's upstream connection pool (shared
by the server's ranks), the roots placed on it, and whether it is up (last poll good and fresh). :class:`Placement` puts a
new root on the live backend with the most KV budget: free blocks above the guard margin of the
controller's own ``kv_target`` (the one it admits by), minus the blocks the controller has
promised to roots already placed there that the backend's telemetry cannot show yet, plus, when
the root's prompt tokens are known and the backend's KV events are followed (``--kv-events``),
the blocks of that prompt the backend already holds (they need no new allocation). Promises are
counted in the controller only (:meth:`ControllerBase.promised_blocks`); ties go to the backend
with fewer roots. A root stays on its backend for life (its KV is there).

That scoring is the ``mars`` placement rule. The others, for comparison (``--placement``, the
cluster sim's ``--placement``): ``round-robin`` (new roots in turn over the live backends),
``session-hash`` (the backend a stable hash of the root id picks; the next live one when that one is
down) and ``least-loaded`` (the fewest requests in the engine, running + waiting, by its last
reading; ties to fewer roots). Every rule places roots only: a root's later turns and children
stay where it was placed. One Placement serves the sidecar, the Ray router and the cluster sim
(:mod:`vllm_mars.sim.cluster`): a backend there is anything with ``name``, ``roots``, ``up`` and a
reader ``telemetry`` (``last``, ``budget_blocks``, ``cache``). With several backends its controller
is :class:`~vllm_mars.admission.replicas.ReplicaAdmission` (a controller per backend; it places a
root when the root arrives and answers the promises of each backend's controller).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from typing import Any

from vllm_mars.admission.base import Telemetry
from vllm_mars.admission.telemetry import HttpTelemetry, RankTelemetry, TelemetryState
from vllm_mars.admission.upstream import UpstreamPool
from vllm_mars.clock import Clock
from vllm_mars.options import check_choice

logger = logging.getLogger(__name__)

#: the guard-margin target used when the controller has none (``none``, ``concur``)
DEFAULT_KV_TARGET = 0.9
#: vLLM's request header that pins a call to one data-parallel rank (read by its OpenAI server)
RANK_HEADER = b"x-data-parallel-rank"
#: the placement rules (module docstring); ``mars`` is the default
PLACEMENT_RULES = ("mars", "round-robin", "session-hash", "least-loaded")


def check_placement(rule: str, name: str = "placement") -> str:
    """``rule`` if it is a placement rule, else ValueError naming ``name`` and the allowed rules."""
    return check_choice(name, rule, PLACEMENT_RULES)


class Backend:
    """One upstream vLLM server, or one data-parallel rank of it (``rank`` not None)."""

    __slots__ = ("name", "pool", "rank", "rank_headers", "roots", "telemetry", "up", "url")

    def __init__(self, url: str, *, telemetry_timeout_s: float = 2.0, telemetry_stale_s: float = 2.0,
                 connect_timeout_s: float = 5.0, clock: Clock | None = None,
                 rank_of: Backend | None = None, rank: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.roots: set[str] = set()
        self.up = False
        if rank_of is None:
            self.telemetry: HttpTelemetry | RankTelemetry = HttpTelemetry(
                self.url, timeout_s=telemetry_timeout_s, stale_s=telemetry_stale_s, clock=clock)
            self.pool = UpstreamPool(self.url, connect_timeout=connect_timeout_s)
            self.rank: str | None = None
        else:
            assert isinstance(rank_of.telemetry, HttpTelemetry) and rank is not None
            self.telemetry = RankTelemetry(rank_of.telemetry, rank)
            self.pool = rank_of.pool
            self.rank = rank
        #: headers added to every call sent here (the rank pin)
        self.rank_headers: list[tuple[bytes, bytes]] = [] if self.rank is None else [(RANK_HEADER, self.rank.encode())]
        #: label in logs and the sidecar's /metrics: the URL, ``URL#rank`` for a rank
        self.name = self.url if self.rank is None else f"{self.url}#{self.rank}"

    def refresh(self) -> bool:
        """Recompute ``up`` (last poll good and fresh); cached so the hot path reads a bool."""
        self.up = self.telemetry.status().state is TelemetryState.OK
        return self.up


def pooled_telemetry(backends: Sequence[Backend]) -> Telemetry | None:
    """The live backends' readings summed into one Telemetry (None when none is live). Its time is
    the oldest reading's, so the controller ages the pool by its stalest member."""
    tels = [b.telemetry.last for b in backends if b.up and b.telemetry.last is not None]
    if not tels:
        return None
    free = sum(t.free_blocks or 0 for t in tels)
    total = sum(t.total_blocks or 0 for t in tels)

    def summed(name: str) -> int | None:  # known only when every live backend reports it
        vals = [getattr(t, name) for t in tels]
        return None if any(v is None for v in vals) else sum(vals)

    return Telemetry(ts=min(t.ts for t in tels), free_blocks=free, total_blocks=total,
                     block_size=tels[0].block_size, kv_usage=(1 - free / total) if total else None,
                     prefix_hit_rate=tels[0].prefix_hit_rate if len(tels) == 1 else None,
                     running=summed("running"), waiting=summed("waiting"), preemptions=summed("preemptions"),
                     retained_blocks=summed("retained_blocks"), recomputed_tokens=summed("recomputed_tokens"),
                     kv_blocks_removed=summed("kv_blocks_removed"))


#: chat fields that change how vLLM renders a prompt (passed to /tokenize as the call has them)
_CHAT_FIELDS = ("model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt",
                "continue_final_message", "chat_template")


async def prompt_token_ids(pool: UpstreamPool, path: str, body: dict, headers: list[tuple[bytes, bytes]],
                           timeout_s: float) -> list[int] | None:
    """The token ids a call's prompt will have, from the backend's ``POST /tokenize`` (vLLM renders
    the chat template there as for the call itself), for prefix-aware placement of a new root; None
    when the call has no prompt /tokenize takes (the Responses API) or the backend does not answer
    in ``timeout_s`` (placement then goes by budget alone)."""
    import asyncio
    import json

    if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
        req = {k: body[k] for k in _CHAT_FIELDS if k in body}
    elif path.endswith("/completions") and isinstance(body.get("prompt"), str):
        req = {k: body[k] for k in ("model", "prompt") if k in body}
    else:
        return None
    resp = None
    try:
        async with asyncio.timeout(timeout_s):
            resp = await pool.request("POST", "/tokenize", headers, json.dumps(req).encode())
            data = b"".join([c async for c in resp.chunks()])
        resp.release()
        if resp.status != 200:
            return None
        toks = json.loads(data).get("tokens")
        return toks if isinstance(toks, list) and all(isinstance(t, int) for t in toks) else None
    except Exception as e:  # noqa: BLE001 (any failure: place by budget, never fail the call)
        if resp is not None:
            resp.close()
        logger.debug("tokenize on %s failed: %s", pool, e)
        return None


class Placement:
    """Chooses the backend of each new root (see the module docstring)."""

    def __init__(self, backends: Sequence[Backend], controller: Any, kv_target: float | None = None,
                 rule: str = "mars") -> None:
        self.rule = check_placement(rule)
        self.backends = list(backends)
        #: the servers polled for /metrics (one per URL, whatever its ranks)
        self.servers = list(self.backends)
        self.controller = controller
        self._kv_target = kv_target
        #: roots placed so far (round-robin's turn)
        self.placed = 0

    def expand_ranks(self) -> list[Backend]:
        """Split every server whose last /metrics page shows more than one ``engine`` label into one
        backend per rank (call after the first poll; a server unreadable then stays one backend).
        Idempotent; returns the new backend list (the servers stay in :attr:`servers`)."""
        out: list[Backend] = []
        for s in self.servers:
            assert isinstance(s.telemetry, HttpTelemetry)
            engines = s.telemetry.engines
            if len(engines) > 1:
                out += [Backend(s.url, rank_of=s, rank=e) for e in engines]
                logger.info("backend %s: %d data-parallel ranks, placed separately (%s)", s.url, len(engines),
                            ", ".join(engines))
            else:
                out.append(s)
        self.backends = out
        return out

    @property
    def kv_target(self) -> float:
        """The explicit override, else the controller's ``kv_target``, else 0.9."""
        if self._kv_target is not None:
            return self._kv_target
        return float(getattr(getattr(self.controller, "config", None), "kv_target", DEFAULT_KV_TARGET))

    def follow_kv_events(self, endpoints: Sequence[str]) -> list[Any]:
        """Subscribe to each server's KV event stream (``endpoints[i]`` for ``servers[i]``, rank 0's
        address; call after :meth:`expand_ranks`) and hang each rank's block index on its backend's
        reader. Returns the started :class:`~vllm_mars.admission.kv_events.KVEventSubscriber` s
        (``close()`` them on shutdown)."""
        from vllm_mars.admission.kv_events import KVEventSubscriber

        if len(endpoints) != len(self.servers):
            raise ValueError(f"--kv-events: give one endpoint per --backend ({len(self.servers)}), got {len(endpoints)}")
        subs = []
        for s, ep in zip(self.servers, endpoints, strict=True):
            ranks = [b for b in self.backends if b.rank is not None and b.pool is s.pool]
            sub = KVEventSubscriber(ep, ranks=max(1, len(ranks)))
            if ranks:
                for b in ranks:
                    b.telemetry.cache = sub.indexes[int(b.rank)] if b.rank.isdigit() else None  # type: ignore[union-attr]
            else:
                s.telemetry.cache = sub.indexes[0]
            subs.append(sub.start())
        return subs

    def score(self, b: Backend, tokens: Sequence[int] | None = None) -> float:
        """KV budget left on ``b`` for a new root, in blocks; with the root's prompt ``tokens`` and
        ``b``'s KV-event index, the prompt's leading blocks ``b`` already holds count as budget too
        (they are reused, not allocated)."""
        promised = getattr(self.controller, "promised_blocks", None)
        owed = promised(b.roots) if promised is not None and b.roots else 0
        cached = 0
        cache = b.telemetry.cache
        if tokens and cache is not None:
            cached = cache.prefix_blocks(tokens)
        return b.telemetry.budget_blocks(self.kv_target) - owed + cached

    def place(self, root: str, tokens: Sequence[int] | None = None) -> Backend:
        """The backend of new root ``root`` by this placement's rule (``tokens``: its prompt, for
        the ``mars`` rule's prefix term); the root is counted on it until :meth:`release`."""
        live = [b for b in self.backends if b.up] or self.backends
        rule = self.rule
        if len(live) == 1:
            best = live[0]  # every rule's only choice: no scoring (its reads have no side effects)
        elif rule == "mars":
            best = max(live, key=lambda b: (self.score(b, tokens), -len(b.roots)))
        elif rule == "round-robin":
            best = live[self.placed % len(live)]
        elif rule == "session-hash":
            n = len(self.backends)
            start = zlib.crc32(root.encode("utf-8", "surrogatepass")) % n
            best = next((b for i in range(n) if (b := self.backends[(start + i) % n]) in live), live[0])
        else:  # least-loaded
            best = min(live, key=lambda b: (self.load(b), len(b.roots)))
        self.placed += 1
        best.roots.add(root)
        return best

    @staticmethod
    def load(b: Backend) -> int:
        """Requests in ``b``'s engine (running + waiting) by its last reading; 0 when unknown."""
        t = b.telemetry.last
        return 0 if t is None else (t.running or 0) + (t.waiting or 0)

    @staticmethod
    def release(root: str, b: Backend | None) -> None:
        if b is not None:
            b.roots.discard(root)
