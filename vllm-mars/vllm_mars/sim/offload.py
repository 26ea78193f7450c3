"""vLLM's CPU KV offload tier (``--kv-offloading-size``) in the virtual-time engine.

Scheduler side: vLLM's own. ``kv_offloading_size=<GiB>`` makes vLLM build its ``OffloadingConnector``
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``) in the scheduler; the sim
builds the very same class (:class:`SimOffloadingConnector` only adds what the sim reads) with the
same ``kv_connector_extra_config``, so vLLM's code decides everything the tier does: which blocks are
stored (every newly computed prompt block, as vLLM's default ``offload_prompt_only``), what a new
request finds on the host (``get_num_new_matched_tokens``: the blocks past the GPU prefix hit that
the host holds), the asynchronous load (the request waits in ``WAITING_FOR_REMOTE_KVS`` while other
requests run), store flushes before a freed block is reused, and the host's LRU eviction
(``CPUOffloadingManager``).

Host capacity. vLLM sizes the host tier in chunks of one GPU block: ``kv_offloading_size`` GiB over
the (alignment-rounded) bytes of one block of the whole model. The sim's scheduler has no KV tensors
and a placeholder KV spec, so ``cpu_bytes_to_use`` is scaled to give vLLM's manager exactly the chunk
count the profile's model would get (:func:`host_tier_config`).

Worker side: a transfer model in virtual time (:class:`HostTransfers`) in place of vLLM's
``OffloadingConnectorWorker``, with its step protocol: at a step's start, the stores deferred from
the previous step are submitted and flushed stores waited for (``handle_preemptions``), then the
step's loads are submitted (``start_kv_transfers``); the step's new stores are deferred to the next
step (``prepare_store_kv``); at the step's end, the jobs done by then are reported
(``get_finished``: loads as ``finished_recving``, all as ``completed_jobs`` with their bytes and
seconds). A job of ``n`` blocks takes ``n x block bytes / PCIe bandwidth`` on its direction's
link (host-to-device for loads, device-to-host for stores: PCIe is full duplex); each direction is
one FIFO queue. Transfers do not slow the step's compute (DMA engines, no SM time); a flush does:
the step waits for it, as vLLM's worker does.

Bandwidth: :data:`PCIE_BYTES_PER_S` unless the profile's hardware gives ``pcie_bandwidth``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.math_utils import round_up
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.outputs import KVConnectorOutput

#: Host link of an H100/H200 SXM: PCIe 5.0 x16 is 32 GT/s x 16 lanes with 128b/130b coding =
#: 63.0 GB/s per direction (PCI-SIG, PCI Express Base Specification 5.0); 50 GB/s is ~80 % of it,
#: the share pinned-memory DMA copies reach after packet overhead (an assumption, not a measurement).
PCIE_BYTES_PER_S = 50e9
#: vLLM's KV connector name the sim registers (``kv_connector_module_path`` = this module).
CONNECTOR = "SimOffloadingConnector"
#: Engine arguments the sim accepts (vLLM's names); everything else comes from --profile.
SIM_ENGINE_ARGS = ("kv_offloading_size", "kv_offloading_backend")


def check_sim_engine_args(args: Mapping[str, Any]) -> float | None:
    """The host tier's GiB from the sim's engine arguments (None: no tier); errors name the field."""
    bad = sorted(k for k in args if k not in SIM_ENGINE_ARGS)
    if bad:
        raise ValueError(f"--engine-arg {bad[0]}: the sim takes its engine from --profile; of vLLM's engine "
                         f"arguments it models only {', '.join(SIM_ENGINE_ARGS)} (the CPU KV offload tier)")
    backend = args.get("kv_offloading_backend", "native")
    if backend != "native":
        raise ValueError(f"--engine-arg kv_offloading_backend={backend!r}: the sim models vLLM's native CPU "
                         "offloading only (allowed: native)")
    size = args.get("kv_offloading_size")
    if size is None:
        if "kv_offloading_backend" in args:
            raise ValueError("--engine-arg kv_offloading_backend needs kv_offloading_size=<GiB>")
        return None
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"--engine-arg kv_offloading_size={size!r}: expected a positive number of GiB")
    return float(size)


@dataclass(frozen=True)
class HostTier:
    """The modelled tier: capacity and link, from the profile's model and hardware."""

    gib: float
    #: KV bytes of one block of the whole model (all layers, all TP ranks)
    block_bytes: int
    #: tokens per block
    block_size: int
    #: per-direction host link bandwidth, bytes/s per GPU
    bandwidth: float
    #: tensor-parallel degree: each GPU moves its 1/tp share over its own link, in parallel
    tp: int = 1

    @classmethod
    def of(cls, profile: Any, gib: float) -> HostTier:
        per_token = getattr(profile, "kv_bytes_per_token", None)
        if per_token is None:
            raise ValueError(f"profile {profile.name!r} gives no KV bytes per token: the CPU offload tier needs "
                             "them (use a shipped profile)")
        hw = getattr(profile, "hardware", None)
        tp = int(getattr(hw, "tp", 1) or 1)
        bw = float(getattr(hw, "pcie_bandwidth", None) or PCIE_BYTES_PER_S)
        return cls(gib, per_token() * profile.block_size * tp, profile.block_size, bw, tp)

    @property
    def num_chunks(self) -> int:
        """Host chunks (one GPU block each) vLLM's CPUOffloadingSpec allots for ``gib``."""
        return int(self.gib * (1 << 30)) // round_up(self.block_bytes, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT)

    def seconds(self, blocks: int) -> float:
        """One direction's transfer time of ``blocks`` blocks (each GPU its share, in parallel)."""
        return blocks * (self.block_bytes / self.tp) / self.bandwidth

    @property
    def seconds_per_token(self) -> float:
        return self.seconds(1) / self.block_size


def host_tier_config(tier: HostTier, rig_block_bytes: int) -> KVTransferConfig:
    """vLLM's native offloading config (as ``kv_offloading_size`` builds it) for the sim's scheduler,
    whose placeholder KV spec has ``rig_block_bytes`` per block: ``cpu_bytes_to_use`` is scaled so that
    vLLM's manager gets ``tier.num_chunks`` chunks."""
    per_chunk = round_up(rig_block_bytes, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT)
    extra = {"cpu_bytes_to_use": tier.num_chunks * per_chunk, "mars_sim_tier": asdict(tier)}
    return KVTransferConfig(kv_connector=CONNECTOR, kv_connector_module_path=__name__, kv_role="kv_both",
                            engine_id="mars-sim", kv_connector_extra_config=extra)


class SimOffloadingConnector(OffloadingConnector):
    """vLLM's OffloadingConnector (scheduler role), as the sim builds it: the GPU platform it models
    (so policies check against that, not the CPU build running the sim) and the tier's link."""

    #: the platform the sim models (MarsScheduler checks the policy against it)
    mars_platform = "cuda"

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.tier = HostTier(**vllm_config.kv_transfer_config.kv_connector_extra_config["mars_sim_tier"])
        self.transfers = HostTransfers(self.tier)

    @property
    def load_seconds_per_token(self) -> float:
        """Host-to-device seconds per token of context (read by infercept_swap's waste model)."""
        return self.tier.seconds_per_token


class _Job:
    __slots__ = ("blocks", "done", "load", "req_id", "seconds")

    def __init__(self, req_id: str, blocks: int, load: bool) -> None:
        self.req_id = req_id
        self.blocks = blocks
        self.load = load
        self.done = 0.0
        self.seconds = 0.0


def _gpu_blocks(spec: Any) -> int:
    return len(spec.block_ids)


class HostTransfers:
    """The worker side in virtual time (module docstring)."""

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        #: when each direction's link is free again
        self._h2d_free = 0.0
        self._d2h_free = 0.0
        self._deferred: list[tuple[int, _Job]] = []  # stores of the last step, submitted at the next
        self._inflight: dict[int, _Job] = {}
        #: counters for engine_stats
        self.loads = 0
        self.load_blocks = 0
        self.load_s = 0.0
        self.stores = 0
        self.store_blocks = 0
        self.store_s = 0.0
        self.flush_wait_s = 0.0

    # -- the step protocol ---------------------------------------------------------------------------
    def _submit(self, job_id: int, job: _Job, now: float) -> None:
        dt = self.tier.seconds(job.blocks)
        if job.load:
            start = max(now, self._h2d_free)
            self._h2d_free = job.done = start + dt
            self.loads += 1
            self.load_blocks += job.blocks
            self.load_s += dt
        else:
            start = max(now, self._d2h_free)
            self._d2h_free = job.done = start + dt
            self.stores += 1
            self.store_blocks += job.blocks
            self.store_s += dt
        job.seconds = dt
        self._inflight[job_id] = job

    def start_step(self, meta: OffloadingConnectorMetadata | None, now: float) -> float:
        """A step starts at ``now`` with vLLM's connector metadata; returns the seconds it waits for
        flushed stores (vLLM's worker blocks on them before the forward pass)."""
        if meta is None:
            return 0.0
        flush = meta.jobs_to_flush or ()
        deferred = self._deferred
        for job_id in flush:  # handle_preemptions: flushed stores of this step go out now
            entry = meta.store_jobs.get(job_id)
            if entry is not None:
                deferred.append((job_id, _Job(entry.req_id, _gpu_blocks(entry.src_spec), False)))
        for job_id, job in deferred:
            self._submit(job_id, job, now)
        deferred.clear()
        wait = 0.0
        for job_id in flush:
            job = self._inflight.get(job_id)
            if job is not None and job.done > now + wait:
                wait = job.done - now
        self.flush_wait_s += wait
        for job_id, entry in meta.load_jobs.items():  # start_kv_transfers
            self._submit(job_id, _Job(entry.req_id, _gpu_blocks(entry.dst_spec), True), now + wait)
        for job_id, entry in meta.store_jobs.items():  # prepare_store_kv: next step
            if job_id not in flush:
                deferred.append((job_id, _Job(entry.req_id, _gpu_blocks(entry.src_spec), False)))
        return wait

    def finish_step(self, now: float) -> KVConnectorOutput | None:
        """get_finished at the step's end ``now``: the jobs done by then (None when none)."""
        done = [j for j, job in self._inflight.items() if job.done <= now]
        if not done:
            return None
        meta = OffloadingWorkerMetadata()
        recving: set[str] = set()
        for job_id in done:
            job = self._inflight.pop(job_id)
            meta.mark_completed(job_id)
            stats = meta.transfer_stats.load if job.load else meta.transfer_stats.store
            stats.record(job.blocks * self.tier.block_bytes, job.seconds)
            if job.load:
                recving.add(job.req_id)
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=meta)

    def idle_s(self, now: float, limit: float) -> float:
        """How long an engine with nothing to schedule sleeps: until the next transfer ends (at most
        ``limit``); 0 while stores wait to be submitted (the next step submits them)."""
        if self._deferred:
            return 0.0
        nxt = min((job.done for job in self._inflight.values()), default=None)
        return limit if nxt is None else min(limit, max(nxt - now, 0.0))

    def pending(self) -> bool:
        return bool(self._deferred or self._inflight)

    def finish_all(self) -> KVConnectorOutput | None:
        """Everything submitted and done (the engine is closing: no virtual time passes)."""
        for job_id, job in self._deferred:
            self._submit(job_id, job, 0.0)
        self._deferred.clear()
        return self.finish_step(float("inf"))

    def stats(self) -> dict[str, Any]:
        bs = self.tier.block_size
        return {"gib": self.tier.gib, "host_blocks": self.tier.num_chunks, "pcie_bytes_per_s": self.tier.bandwidth,
                "loads": self.loads, "load_tokens": self.load_blocks * bs, "load_s": round(self.load_s, 6),
                "stores": self.stores, "store_tokens": self.store_blocks * bs, "store_s": round(self.store_s, 6),
                "flush_wait_s": round(self.flush_wait_s, 6)}


# -- what the sim engine calls ---------------------------------------------------------------------------
def transfers_of(scheduler: Any) -> HostTransfers | None:
    """The transfer model of a scheduler built with the tier (None without)."""
    c = getattr(scheduler, "connector", None)
    return c.transfers if isinstance(c, SimOffloadingConnector) else None


def with_transfers(out: Any, xfer: HostTransfers, now: float) -> Any:
    """``out`` (a ModelRunnerOutput) carrying the transfers done by ``now``."""
    out.kv_connector_output = xfer.finish_step(now)
    return out


def drain(scheduler: Any, token: int) -> None:
    """Finish the tier's work after the last request left (closing): the stores vLLM issues for
    finished requests at the next ``schedule()``, and every transfer still in flight."""
    from vllm_mars.engine.rig import fake_model_output

    xfer = transfers_of(scheduler)
    if xfer is None:
        return
    for _ in range(16):
        so = scheduler.schedule()
        xfer.start_step(so.kv_connector_metadata, 0.0)
        out = fake_model_output(scheduler, so, token)
        out.kv_connector_output = xfer.finish_all()
        scheduler.update_from_output(so, out)
        if not scheduler.has_requests() and not xfer.pending():
            return
    raise RuntimeError("sim offload tier: transfers still pending after draining")


def host_tier_accounting(scheduler: Any) -> dict[str, int]:
    """The host tier's chunks by state (vLLM's manager) and the connector's open jobs/requests."""
    c = scheduler.connector
    sched = c.connector_scheduler
    m = sched.manager
    held = m._num_allocated_chunks - len(m._free_list)
    return {"capacity": m._num_chunks, "held": held, "evictable": m._num_evictable_cache_chunks,
            "write_pending": m._num_write_pending_chunks, "jobs": len(sched._jobs),
            "requests": len(sched._req_status)}


def assert_host_tier_clean(scheduler: Any) -> None:
    """No transfer or request left in the tier; every chunk it holds is a finished copy (evictable)."""
    if transfers_of(scheduler) is None:
        return
    acc = host_tier_accounting(scheduler)
    ok = (acc["jobs"] == 0 and acc["requests"] == 0 and acc["write_pending"] == 0
          and acc["held"] == acc["evictable"] and acc["held"] <= acc["capacity"])
    assert ok and not transfers_of(scheduler).pending(), f"host tier not clean: {acc}"
