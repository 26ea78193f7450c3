"""Readers of engine state for the admission controllers. No vllm import.

* :class:`InProcessTelemetry`: straight from a ``MarsScheduler`` in this process
  (``free_blocks()`` = free + evictable cached blocks; blocks held by retention are referenced, so
  they are not free) plus an optional tool-plane source.
* :class:`HttpTelemetry`: vLLM's Prometheus ``/metrics`` (the one parser, also the driver's HTTP
  backend's): total = the ``num_gpu_blocks`` label of
  ``vllm:cache_config_info`` minus vLLM's null block, free = ``(1 - vllm:kv_cache_usage_perc) x
  total`` (vLLM computes the usage from the same free count, so this is exact up to rounding),
  prefix hit rate from the deltas of ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``.

Failures and staleness are explicit: :class:`TelemetryStatus` says ``ok``, ``stale`` (the last good
reading is older than ``stale_s``), ``failed`` (the last poll failed; the last good reading, if
any, is kept for the controller to age), or ``missing`` (never read). A reader never hands a
controller an empty reading on failure: the controller sees the last good one get old, which it
treats as pressure.
"""

from __future__ import annotations

import enum
import logging
import math
import re
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_mars.admission.base import Telemetry, ToolStats
from vllm_mars.clock import Clock, MonotonicClock

logger = logging.getLogger(__name__)


class TelemetryState(str, enum.Enum):
    OK = "ok"
    STALE = "stale"
    FAILED = "failed"
    MISSING = "missing"


@dataclass(frozen=True)
class TelemetryStatus:
    state: TelemetryState
    #: the last good reading (None when missing)
    reading: Telemetry | None
    #: seconds since the last good reading (None when missing)
    age_s: float | None
    error: str | None = None


class InProcessTelemetry:
    """Reads a MarsScheduler (anything with ``mars_stats()``) in this process."""

    def __init__(self, scheduler: Any, clock: Clock | None = None,
                 tool_stats: Callable[[], ToolStats] | None = None) -> None:
        self.scheduler = scheduler
        self.clock = clock or MonotonicClock()
        self.tool_stats = tool_stats

    def read(self) -> Telemetry:
        s = self.scheduler.mars_stats()
        total = int(s["num_blocks"])
        free = int(s["free_blocks"])
        ts = self.tool_stats() if self.tool_stats else None
        return Telemetry(
            ts=self.clock.now(), free_blocks=free, total_blocks=total, block_size=int(s["block_size"]),
            kv_usage=(1.0 - free / total) if total else None,
            tools_in_flight=ts.in_flight if ts else None, tool_workers=ts.workers if ts else None,
            tool_queue_wait_s=ts.ema_queue_wait_s if ts else None)


def EngineSample(ts: float, num_blocks: int | None = None, **fields: Any) -> Telemetry:
    """An engine reading as the one :class:`~vllm_mars.admission.base.Telemetry` (the engine calls
    the pool's size ``num_blocks``; Telemetry ``total_blocks``)."""
    return Telemetry(ts=ts, total_blocks=num_blocks, **fields)


def scheduler_reading(s: Any, ts: float) -> Telemetry:
    """A MarsScheduler's engine reading now, read straight from the scheduler: the counters
    ``mars_stats()`` reports under the same names (:func:`~vllm_mars.engine.observe.scheduler_stats`),
    without building the rest of that dict (the policy's state, the retention's counters, the cost
    model), which the simulator's admission tick would otherwise build every 0.2 virtual seconds."""
    free, total = s.free_blocks(), s.num_blocks
    events = s._kv_events
    return EngineSample(
        ts=ts, free_blocks=free, num_blocks=total, block_size=s.block_size,
        kv_usage=(1.0 - free / total) if total else None, retained_blocks=s.retention.num_blocks,
        preemptions=s.mars_num_preemptions, recomputed_tokens=s.mars_recomputed_tokens,
        kv_blocks_removed=events.blocks_removed if events else None, running=len(s.running), waiting=len(s.waiting))


def scheduler_sample(s: Any, ts: float) -> tuple[Telemetry, dict[str, Any]]:
    """(reading, mars_stats) of a MarsScheduler's state now (:func:`scheduler_reading`): the
    in-process backend's telemetry and the counters it reports at the end."""
    return scheduler_reading(s, ts), s.mars_stats()


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format -> {metric name: [(labels, value)]}; comments and junk lines skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def metric_sum(metrics: dict, *names: str) -> float | None:
    """The sum over labels (engines) of the first of ``names`` on the page; None when absent."""
    for n in names:
        if n in metrics:
            return sum(v for _, v in metrics[n])
    return None



class MetricsError(ValueError):
    """A /metrics page without the series we need."""


def metric_engines(m: dict) -> list[str]:
    """The ``engine`` labels (vLLM's data-parallel ranks) on a parsed /metrics page, in rank order;
    vLLM labels every per-engine series ``engine="<rank>"`` (one row per rank)."""
    seen = {lab.get("engine") for lab, _ in (m.get("vllm:kv_cache_usage_perc") or m.get("vllm:gpu_cache_usage_perc") or [])}
    engines = [e for e in seen if e is not None and e != ""]
    return sorted(engines, key=lambda e: (not e.isdigit(), int(e) if e.isdigit() else 0, e))


def _only(m: dict, engine: str | None) -> dict:
    """The page restricted to one engine's rows (series without an engine label are kept)."""
    if engine is None:
        return m
    return {k: [(lab, v) for lab, v in rows if lab.get("engine", engine) == engine] for k, rows in m.items()}


def telemetry_from_metrics(text: str | dict, ts: float,
                           prev_counters: tuple[float, float] | None = None, engine: str | None = None
                           ) -> tuple[Telemetry, tuple[float, float] | None]:
    """One Telemetry from a vLLM /metrics page (text, or already parsed by
    :func:`parse_prometheus`), and the (hits, queries) counters for the next delta. ``preemptions``
    is the server's cumulative counter; ``running``/``waiting`` sum over engines. ``engine``: only
    that data-parallel rank's rows (its ``engine`` label), else the whole server."""
    m = parse_prometheus(text) if isinstance(text, str) else text
    m = _only(m, engine)
    usage_rows = m.get("vllm:kv_cache_usage_perc") or m.get("vllm:gpu_cache_usage_perc")
    info = m.get("vllm:cache_config_info")
    where = "" if engine is None else f' for engine="{engine}"'
    if not usage_rows:
        raise MetricsError(f"no vllm:kv_cache_usage_perc series on /metrics{where}")
    if not info or "num_gpu_blocks" not in info[0][0]:
        raise MetricsError(f"no num_gpu_blocks label on vllm:cache_config_info{where}")
    try:
        # one engine: one row; data-parallel engines: blocks add up, usage is the block-weighted mean
        gpu_blocks = int(info[0][0]["num_gpu_blocks"])
        block_size = int(info[0][0]["block_size"]) if "block_size" in info[0][0] else None
    except ValueError as e:
        raise MetricsError(f"bad vllm:cache_config_info label: {e}") from None
    n_eng = max(1, len(usage_rows))
    total = max(0, gpu_blocks - 1) * n_eng  # vLLM's usage excludes its null block
    usage = sum(v for _, v in usage_rows) / n_eng
    free = max(0, min(total, round((1.0 - usage) * total)))
    hits = metric_sum(m, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")
    queries = metric_sum(m, "vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")
    hit_rate = None
    counters = None
    if hits is not None and queries is not None:
        counters = (hits, queries)
        if prev_counters is not None and queries > prev_counters[1]:
            hit_rate = (hits - prev_counters[0]) / (queries - prev_counters[1])
    pre = metric_sum(m, "vllm:num_preemptions_total", "vllm:num_preemptions")
    running = metric_sum(m, "vllm:num_requests_running")
    waiting = metric_sum(m, "vllm:num_requests_waiting")
    tel = Telemetry(ts=ts, free_blocks=free, total_blocks=total, block_size=block_size, kv_usage=usage,
                    prefix_hit_rate=hit_rate, preemptions=None if pre is None else int(pre),
                    running=None if running is None else int(running),
                    waiting=None if waiting is None else int(waiting))
    return tel, counters


class _Reader:
    """``status()`` and ``budget_blocks()`` from ``last``/``error``/``clock``/``stale_s``: shared by a
    whole server's reader and a data-parallel rank's view of it. ``cache``: the replica's KV-event
    block index (:class:`~vllm_mars.admission.kv_events.BlockIndex`) when ``--kv-events`` feeds it."""

    last: Telemetry | None
    error: str | None
    clock: Clock
    stale_s: float
    cache: Any = None

    def status(self) -> TelemetryStatus:
        last = self.last
        if last is None:
            return TelemetryStatus(TelemetryState.MISSING, None, None, self.error)
        age = self.clock.now() - last.ts
        if self.error is not None:
            return TelemetryStatus(TelemetryState.FAILED, last, age, self.error)
        if age > self.stale_s:
            return TelemetryStatus(TelemetryState.STALE, last, age)
        return TelemetryStatus(TelemetryState.OK, last, age)

    def budget_blocks(self, kv_target: float = 0.9) -> float:
        """Free blocks above the guard margin from the last reading; -inf when unknown or failed
        (used to place new roots on the replica with the most room)."""
        s = self.status()
        if s.state is not TelemetryState.OK or s.reading is None:
            return -math.inf
        t = s.reading
        assert t.free_blocks is not None and t.total_blocks is not None
        return t.free_blocks - math.ceil(t.total_blocks * (1 - kv_target))


class HttpTelemetry(_Reader):
    """Polls one vLLM server's /metrics. ``poll_upstream`` with the sidecar's pooled upstream
    client, ``poll`` with the standard library (scripts and the driver)."""

    def __init__(self, base_url: str, *, timeout_s: float = 2.0, stale_s: float = 2.0,
                 clock: Clock | None = None, headers: dict[str, str] | None = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {base_url!r}")
        if timeout_s <= 0 or stale_s <= 0:
            raise ValueError(f"timeout_s and stale_s must be > 0, got {timeout_s}, {stale_s}")
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/metrics"
        self.timeout_s = timeout_s
        self.stale_s = stale_s
        self.clock = clock or MonotonicClock()
        self.headers = headers or {}
        self.last: Telemetry | None = None
        self.error: str | None = None
        self.failures = 0
        self._counters: tuple[float, float] | None = None
        self._head: list[tuple[bytes, bytes]] | None = None
        #: the data-parallel ranks (``engine`` labels) on the last page, in rank order
        self.engines: list[str] = []
        #: each rank's own reading when the server has more than one (see :class:`RankTelemetry`)
        self.per_engine: dict[str, Telemetry] = {}
        self._engine_counters: dict[str, tuple[float, float] | None] = {}

    def _ingest(self, text: str, ts: float) -> Telemetry:
        m = parse_prometheus(text)
        tel, self._counters = telemetry_from_metrics(m, ts, self._counters)
        engines = metric_engines(m)
        if len(engines) > 1:
            per = {}
            for e in engines:
                per[e], self._engine_counters[e] = telemetry_from_metrics(m, ts, self._engine_counters.get(e), e)
            self.per_engine = per
        self.engines = engines
        self.last, self.error = tel, None
        return tel

    def _fail(self, err: BaseException | str) -> None:
        self.error = str(err) or type(err).__name__
        self.failures += 1
        logger.debug("telemetry from %s failed: %s", self.url, self.error)

    def poll(self) -> TelemetryStatus:
        ts = self.clock.now()
        try:
            req = urllib.request.Request(self.url, headers=self.headers)
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                self._ingest(r.read().decode("utf-8", "replace"), ts)
        except (OSError, MetricsError, ValueError) as e:
            self._fail(e)
        return self.status()

    async def poll_upstream(self, pool: Any) -> TelemetryStatus:
        """Poll through the sidecar's pooled upstream client
        (:class:`~vllm_mars.admission.upstream.UpstreamPool`: kept-alive connections, the same lean
        client its proxied calls use); ``timeout_s`` bounds the whole poll."""
        import asyncio

        from vllm_mars.admission.upstream import UpstreamBroken, UpstreamUnreachable

        ts = self.clock.now()
        if self._head is None:
            self._head = [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        resp = None
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await pool.request("GET", "/metrics", self._head)
                body = b"".join([c async for c in resp.chunks()])
            resp.release()
            if resp.status != 200:
                raise MetricsError(f"GET {self.url} -> HTTP {resp.status}")
            self._ingest(body.decode("utf-8", "replace"), ts)
        except (UpstreamUnreachable, UpstreamBroken, OSError, TimeoutError, MetricsError, ValueError) as e:
            if resp is not None:
                resp.close()
            self._fail(e if not isinstance(e, TimeoutError) else f"no answer within {self.timeout_s} s")
        return self.status()


class RankTelemetry(_Reader):
    """One data-parallel rank of a server, read from its server's :class:`HttpTelemetry` (one GET
    of /metrics serves every rank): the rank's own reading (its ``engine`` label), the server's
    failures (an unreachable server takes all its ranks down)."""

    def __init__(self, server: HttpTelemetry, engine: str) -> None:
        self.server = server
        self.engine = engine
        self.cache = None

    @property
    def last(self) -> Telemetry | None:  # type: ignore[override]
        return self.server.per_engine.get(self.engine)

    @property
    def error(self) -> str | None:  # type: ignore[override]
        if self.server.error is None and self.server.last is not None and self.engine not in self.server.per_engine:
            return f'engine="{self.engine}" no longer on {self.server.url}'
        return self.server.error

    @property
    def clock(self) -> Clock:  # type: ignore[override]
        return self.server.clock

    @property
    def stale_s(self) -> float:  # type: ignore[override]
        return self.server.stale_s

    @property
    def url(self) -> str:
        return self.server.url

    def _fail(self, err: BaseException | str) -> None:
        self.server._fail(err)

    async def poll_upstream(self, pool: Any) -> TelemetryStatus:
        await self.server.poll_upstream(pool)
        return self.status()
