"""Step times from measured kernels: tables built from NVIDIA's aiconfigurator-core vLLM data.

A :class:`KernelTables` is what one engine step costs on one GPU x model x TP, as four tables
interpolated per step (no FLOP or byte counting, no efficiency priors):

- ``linear_s[tokens]``: every non-attention op of the forward pass for a batch of that many tokens
  (embedding, norms, QKV/O projections, dense GEMMs or router + fused MoE, TP all-reduces);
- ``logits_s[seqs]``: the lm_head GEMM, one row per scheduled request (vLLM computes logits for
  each request's last token only);
- ``prefill_attn_s[chunk][prefix]``: context attention of one prefill chunk after ``prefix``
  cached tokens (every attention layer together);
- ``decode_attn_s[batch][context]``: generation attention of ``batch`` decodes at ``context``
  tokens each.

One step = ``linear(T) + logits(n) + sum(prefill_attn(chunk, prefix)) + decode_attn(d, mean ctx)
+ step_overhead_s + per_seq_overhead_s * n`` (T scheduled tokens, n scheduled requests, d decodes;
1-D tables piecewise linear, 2-D bilinear, both extrapolated linearly past their last point).
The two overheads are the profile's (``Efficiency``), fitted once (see
``benchmark/perf/gpu_validation.py --fit-overheads``) and applied to every table-built profile.
With async scheduling (``Profile.from_kernels(scheduling="async")``, the default, as vLLM 0.32 runs
on a GPU: :data:`DEFAULT_SCHEDULING`) that CPU work overlaps the kernels instead: step =
``max(kernels, overlapped CPU time) + the non-overlapped rest``.

:func:`build_tables` fills the tables from aiconfigurator-core (``pip install
'vllm-mars[kernels]'``): its compiled engine over its per-kernel silicon tables for vLLM, queried
op by op (``EngineHandle.evaluate_context_ops`` / ``evaluate_generation_ops``). The shipped
profiles carry the tables themselves, so the sim needs no aiconfigurator at run time. The tables
were measured with vLLM 0.24 (the newest the 0.12.0 wheel holds); this project pins vLLM 0.32:
``source`` records both.

The library is imported lazily here (a heavy optional dependency: only building tables needs it).
"""

from __future__ import annotations

import bisect
import datetime as dt
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

#: the distribution that ships the kernel tables, and the version the shipped profiles were built with
LIBRARY = "aiconfigurator-core"
LIBRARY_VERSION = "0.12.0"
#: the vLLM this project runs (the tables are older: ``table_vllm`` in each profile's source)
PINNED_VLLM = "0.32.0"
#: the per-step and per-request overheads the tables do not hold (scheduler, input preparation,
#: sampling, output processing), fitted once by ``benchmark/perf/gpu_validation.py --fit-overheads``
#: on the H100 x Qwen3-32B rows of silicon_sample.csv and used by every table-built profile (fitted with
#: the steady-state replay that script used on 2026-12-04; under the rows' benchmark protocol, which
#: replaced it, TPOT stays within a median 1.01, so they were kept and the shipped profiles did not move)
STEP_OVERHEAD_S = 1.46e-3
PER_SEQ_OVERHEAD_S = 6.4e-5
OVERHEAD_SOURCE = ("benchmark/perf/gpu_validation.py --fit-overheads --gpu h100 --model qwen3-32b "
                   "--max-concurrency 64: TPOT of 72 published H100 x Qwen3-32B configurations, 2026-12-04")
#: with vLLM's async scheduling (``--async-scheduling``; on by default in the vLLM of the gpt-oss rows,
#: 0.18, and in the pinned 0.32) the CPU work above runs while the GPU runs the previous step: it becomes
#: the profile's overlapped CPU time, and only the part below stays on the critical path. Fitted once
#: by ``gpu_validation.py --fit-overheads --scheduling async`` on the TPOT of the H100 x gpt-oss-120b
#: rows (vLLM 0.18, async by default); the H200 rows are out of sample. Fitted on the gpt-oss tables as
#: built before :func:`op_names` (full attention then missing from decode); on the fixed tables the same
#: fit gives 0.027 ms per step and 32.4 us per request (benchmark/perf/RESULTS.md, gpu_validation), about
#: 0.3 ms more per 64-request step: not applied, as it moves every async table-built profile
ASYNC_STEP_OVERHEAD_S = 0.0
ASYNC_PER_SEQ_OVERHEAD_S = 2.79e-5
ASYNC_OVERHEAD_SOURCE = ("benchmark/perf/gpu_validation.py --fit-overheads --scheduling async --gpu h100 "
                         "--model gpt-oss-120b --max-osl 1024: TPOT of 28 published H100 x gpt-oss-120b "
                         "vLLM 0.18 configurations (InferenceX), 2026-12-05")
#: how a table-built profile schedules: sync (the CPU overheads between steps) or async (overlapped)
SCHEDULING = ("sync", "async")
#: how the pinned vLLM schedules on every setup a table-built profile describes (one CUDA GPU or TP on one
#: node, a generative model, no speculative decoding, no pipeline parallelism): async. vLLM 0.32's
#: ``VllmConfig.__post_init__`` (``vllm/config/vllm.py``) turns ``async_scheduling`` on when it is left
#: unset unless the runner is a pooling one, speculative decoding is of a kind other than EAGLE/MTP, draft
#: model, n-gram GPU, DSpark or DFlash (or has ``disable_padded_drafter_batch``), the executor lacks
#: ``supports_async_scheduling()`` (only the uniprocess and multiprocess executors have it: TP 1 runs the
#: first, TP > 1 on one node the second; Ray has not), ROCm DeepEP high-throughput DBO, or pipeline
#: parallelism on the V1 model runner; only the CPU platform (``vllm/platforms/cpu.py``) turns it off
#: regardless, which is why the CPU engine here runs synchronously
DEFAULT_SCHEDULING = "async"

#: aiconfigurator's name of each GPU the profiles know, and the datasheet figures of ours
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm"}
_GIB = 1 << 30
#: CUDA-visible total of an H100 SXM5 80GB as vLLM logs it (``total_gpu_memory 79.22GiB``, vLLM PR
#: #10511 and #12126 memory-profiling logs) against nvidia-smi's 81559 MiB: the driver keeps the rest
_H100_CUDA = int(79.22 * _GIB)
_H100_SMI = 81559 << 20
#: per GPU: (name, dense BF16 peak FLOP/s, HBM B/s, nvidia-smi memory.total, NVLink B/s per direction).
#: H100/H200: NVIDIA H100 and H200 datasheets (989.4 TFLOP/s = 1,979 sparse / 2; 3.35 / 4.8 TB/s;
#: NVLink 4 900 GB/s bidirectional); B200: HGX B200 datasheet (2.25 PFLOP/s dense BF16, 8 TB/s HBM3e,
#: NVLink 5 1.8 TB/s bidirectional), 180 GB as nvidia-smi's 183359 MiB
GPUS = {
    "h100": ("NVIDIA H100 SXM5 80GB", 989.4e12, 3.35e12, _H100_SMI, 450e9),
    "h200": ("NVIDIA H200 SXM 141GB", 989.4e12, 4.8e12, 143771 << 20, 450e9),
    "b200": ("NVIDIA B200 180GB", 2.25e15, 8.0e12, 183359 << 20, 900e9),
}


def cuda_visible_bytes(gpu: str) -> int:
    """What ``torch.cuda.mem_get_info()`` reports as total: measured on H100 (79.22 GiB); for the
    others nvidia-smi's total less the same driver reserve as on H100 (derived, not measured)."""
    smi = GPUS[gpu][3]
    return _H100_CUDA if gpu == "h100" else smi - (_H100_SMI - _H100_CUDA)


#: PyTorch activation peak of vLLM's profile run (8192 batched tokens) per architecture class, GiB:
#: llm-d-planner's constants validated against vLLM startup logs (llm-d-incubation/llm-d-planner
#: issue #194: Llama 4.8 and Qwen2/Qwen3 5.6 validated; 8.0 the MoE class value, used for gpt-oss too)
ACTIVATION_GIB = {"LlamaForCausalLM": 4.8, "Qwen3ForCausalLM": 5.6, "Qwen2ForCausalLM": 5.6,
                  "Qwen3MoeForCausalLM": 8.0, "GptOssForCausalLM": 8.0, "MixtralForCausalLM": 8.0}
#: memory outside torch vLLM measures (CUDA context, cuBLAS workspace; NCCL buffers at TP > 1), GiB:
#: vLLM PR #10511's memory-profiling log, Llama-3-8B on H100 (non_torch_memory 1.79 GiB at TP 1,
#: 3.58 GiB at TP 2)
NON_TORCH_GIB = {1: 1.79, 2: 3.58}


def memory_of(architecture: str, tp: int) -> tuple[int, int]:
    """(activation peak bytes, non-torch bytes) for a model class at TP ``tp`` (see the sources above);
    an unknown class takes the largest (MoE) activation figure."""
    act = ACTIVATION_GIB.get(architecture, max(ACTIVATION_GIB.values()))
    return int(act * _GIB), int(NON_TORCH_GIB[1 if tp == 1 else 2] * _GIB)


#: dtype flag -> aiconfigurator gemm / moe quant mode (None: the model's own, e.g. mxfp4 for gpt-oss)
DTYPES = {"bfloat16": "bfloat16", "fp8": "fp8", "auto": None}


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), linear past either end (xs ascending, >= 2 points)."""
    i = bisect.bisect_right(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    y0 = ys[i - 1]
    return y0 + (ys[i] - y0) * (x - x0) / (x1 - x0)


def _interp2(xs: Sequence[float], ys: Sequence[float], grid: Sequence[Sequence[float]], x: float, y: float) -> float:
    """Bilinear over ``grid[i][j]`` at (xs[i], ys[j]), linear past the edges."""
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    a = _interp(ys, grid[i - 1], y)
    b = _interp(ys, grid[i], y)
    return a + (b - a) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class KernelTables:
    """Step-time tables of one GPU x model x TP (see the module docstring); seconds."""

    tokens: tuple[float, ...]
    linear_s: tuple[float, ...]
    seqs: tuple[float, ...]
    logits_s: tuple[float, ...]
    chunks: tuple[float, ...]
    prefixes: tuple[float, ...]
    prefill_attn_s: tuple[tuple[float, ...], ...]
    batches: tuple[float, ...]
    contexts: tuple[float, ...]
    decode_attn_s: tuple[tuple[float, ...], ...]
    #: provenance: library and version, GPU, model, TP, dtype, the vLLM version of the tables, date
    source: str = ""

    def __post_init__(self) -> None:
        for axis, vals in (("tokens", self.linear_s), ("seqs", self.logits_s), ("chunks", self.prefill_attn_s),
                           ("batches", self.decode_attn_s)):
            xs = getattr(self, axis)
            if len(xs) < 2 or len(vals) != len(xs) or any(b <= a for a, b in itertools.pairwise(xs)):
                raise ValueError(f"kernels.{axis}: need >= 2 ascending points and one value per point")
        for axis, grid in (("prefixes", self.prefill_attn_s), ("contexts", self.decode_attn_s)):
            ys = getattr(self, axis)
            if len(ys) < 2 or any(len(row) != len(ys) for row in grid) or any(
                    b <= a for a, b in itertools.pairwise(ys)):
                raise ValueError(f"kernels.{axis}: need >= 2 ascending points and one value per point in every row")
        for name in ("linear_s", "logits_s"):
            if any(not v >= 0 for v in getattr(self, name)):
                raise ValueError(f"kernels.{name}: every value must be >= 0")
        for name in ("prefill_attn_s", "decode_attn_s"):
            if any(not v >= 0 for row in getattr(self, name) for v in row):
                raise ValueError(f"kernels.{name}: every value must be >= 0")

    def step_seconds(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        """Kernel time of one step (no overheads): ``prefill`` = (chunk, prefix) per chunk, ``decode``
        = context per decoding request."""
        n = len(prefill) + len(decode)
        if n == 0:
            return 0.0
        tokens = len(decode)
        t = 0.0
        for chunk, prefix in prefill:
            tokens += chunk
            t += max(_interp2(self.chunks, self.prefixes, self.prefill_attn_s, chunk, prefix), 0.0)
        if decode:
            d = len(decode)
            t += max(_interp2(self.batches, self.contexts, self.decode_attn_s, d, sum(decode) / d), 0.0)
        t += max(_interp(self.tokens, self.linear_s, tokens), 0.0)
        return t + max(_interp(self.seqs, self.logits_s, n), 0.0)

    def scaled(self, factor: float) -> KernelTables:
        """Every table x ``factor`` (the same kernels ``factor`` times slower)."""
        def row(v: Sequence[float]) -> tuple[float, ...]:
            return tuple(x * factor for x in v)

        return KernelTables(self.tokens, row(self.linear_s), self.seqs, row(self.logits_s), self.chunks,
                            self.prefixes, tuple(row(r) for r in self.prefill_attn_s), self.batches, self.contexts,
                            tuple(row(r) for r in self.decode_attn_s), f"{self.source}; x {factor:g}")

    # -- file form ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "tokens": list(self.tokens), "linear_s": list(self.linear_s),
                "seqs": list(self.seqs), "logits_s": list(self.logits_s), "chunks": list(self.chunks),
                "prefixes": list(self.prefixes), "prefill_attn_s": [list(r) for r in self.prefill_attn_s],
                "batches": list(self.batches), "contexts": list(self.contexts),
                "decode_attn_s": [list(r) for r in self.decode_attn_s]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> KernelTables:
        """From :meth:`to_dict`; ValueError naming ``where`` and the field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: field 'kernels' must be a table/object")  # noqa: TRY004
        names = {"source", "tokens", "linear_s", "seqs", "logits_s", "chunks", "prefixes", "prefill_attn_s",
                 "batches", "contexts", "decode_attn_s"}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"{where}: unknown field 'kernels.{bad[0]}' (known: {', '.join(sorted(names))})")
        kw: dict[str, Any] = {}
        for key in sorted(names - {"source"}):
            if key not in d:
                raise ValueError(f"{where}: missing field 'kernels.{key}'")
            v = d[key]
            try:
                if key.endswith("_attn_s"):
                    kw[key] = tuple(tuple(_num(x) for x in row) for row in v)
                else:
                    kw[key] = tuple(_num(x) for x in v)
            except (TypeError, ValueError):
                shape = "a list of lists of numbers" if key.endswith("_attn_s") else "a list of numbers"
                raise ValueError(f"{where}: field 'kernels.{key}' must be {shape}") from None
        src = d.get("source", "")
        if not isinstance(src, str):
            raise ValueError(f"{where}: field 'kernels.source' must be a string")  # noqa: TRY004 (CLI: exit 2)
        try:
            return cls(source=src, **kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _num(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(x)
    return float(x)


# -- building from aiconfigurator-core ---------------------------------------------------------------
def _grid(top: int, points: Sequence[int]) -> list[int]:
    """``points`` below ``top``, then ``top`` itself."""
    return sorted({p for p in points if p < top} | {top})


def library_version() -> str:
    """The installed aiconfigurator-core version; ImportError naming the extra when it is absent."""
    try:
        return version(LIBRARY)
    except PackageNotFoundError:
        raise ImportError(f"{LIBRARY} is not installed: pip install 'vllm-mars[kernels]' "
                          f"({LIBRARY}=={LIBRARY_VERSION})") from None


def system_name(gpu: str) -> str:
    """aiconfigurator's system name for ``gpu`` (h100, h200, b200 or its own name, e.g. h100_sxm)."""
    g = gpu.lower()
    if g in SYSTEMS:
        return SYSTEMS[g]
    if g in SYSTEMS.values():
        return g
    raise ValueError(f"GPU {gpu!r}: not one of {', '.join(sorted(SYSTEMS))} "
                     f"(or aiconfigurator's {', '.join(sorted(SYSTEMS.values()))})")


def op_names(evaluate) -> list[str]:
    """The name of every op of an engine's context or generation op list, by the position
    ``evaluate`` (``EngineHandle.evaluate_context_ops`` / ``evaluate_generation_ops``) takes.

    Asked op by op, not read from ``run_static_per_op``: that list folds ops of one name into one
    entry (gpt-oss's sliding-window and full attention are two ops named ``context_attention``), so
    its positions are not the ones ``evaluate`` takes."""
    names: list[str] = []
    while True:
        try:
            out = evaluate([len(names)], batch_size=1, s=1024)
        except ValueError as e:
            if "out of range" not in str(e):
                raise
            return names
        names.append(out[0][0] if out else "")


def build_tables(system: str, model: str | Path, *, tp: int = 1, dtype: str = "auto",
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024,
                 max_model_len: int = 32768) -> KernelTables:
    """Query aiconfigurator-core's vLLM kernel tables for ``model`` (a config-only model dir or an
    id its ``model_configs`` knows) on ``system`` at TP ``tp``; tables span the engine limits.

    ValueError naming the allowed values for an unknown GPU or dtype; the library's own error
    (naming what it lacks) for a model or GPU its tables do not cover."""
    ver = library_version()
    system = system_name(system)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: not one of {', '.join(DTYPES)}")
    if not (isinstance(tp, int) and tp >= 1):
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    # the library logs every fallback table it loads at WARNING; its provenance goes to `source`
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    from aiconfigurator_core.sdk.engine import EngineHandle
    from aiconfigurator_core.sdk.perf_database import resolve_query_version

    table_vllm = resolve_query_version(system, "vllm", "current")
    quant = DTYPES[dtype]
    kw: dict[str, Any] = {"tp_size": tp, "moe_tp_size": tp, "moe_ep_size": 1}
    if quant:
        kw.update(gemm_quant_mode=quant, moe_quant_mode=quant)
    handle = EngineHandle.compile(str(model), system, "vllm", backend_version=table_vllm, **kw)
    ctx_names = op_names(handle.evaluate_context_ops)
    gen_names = op_names(handle.evaluate_generation_ops)
    linear = [i for i, n in enumerate(ctx_names) if "attention" not in n and "logits" not in n]
    ctx_attn = [i for i, n in enumerate(ctx_names) if "attention" in n]
    gen_attn = [i for i, n in enumerate(gen_names) if "attention" in n]
    logits = [i for i, n in enumerate(gen_names) if "logits" in n]
    if not (linear and ctx_attn and gen_attn and logits):
        raise ValueError(f"{model} on {system}: the library's op lists lack linear, attention or logits ops "
                         f"({ctx_names}; {gen_names})")

    def ms(ops: list) -> float:
        return sum(float(op[1]) for op in ops) / 1e3

    tokens = _grid(max_num_batched_tokens + max_num_seqs,
                   [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                    4096, 6144, 8192, 12288, 16384])
    seqs = _grid(max_num_seqs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    chunks = _grid(max_num_batched_tokens, [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    prefixes = [0, *_grid(max_model_len, [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072])]
    batches = _grid(max_num_seqs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    contexts = _grid(max_model_len, [16, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072])
    ctx = handle.evaluate_context_ops
    gen = handle.evaluate_generation_ops
    tables = KernelTables(
        tokens=tuple(map(float, tokens)),
        linear_s=tuple(ms(ctx(linear, batch_size=1, s=t)) for t in tokens),
        seqs=tuple(map(float, seqs)),
        logits_s=tuple(ms(gen(logits, batch_size=n, s=1024)) for n in seqs),
        chunks=tuple(map(float, chunks)), prefixes=tuple(map(float, prefixes)),
        prefill_attn_s=tuple(tuple(ms(ctx(ctx_attn, batch_size=1, s=c, prefix=p)) for p in prefixes) for c in chunks),
        batches=tuple(map(float, batches)), contexts=tuple(map(float, contexts)),
        decode_attn_s=tuple(tuple(ms(gen(gen_attn, batch_size=b, s=c)) for c in contexts) for b in batches),
        source=(f"{LIBRARY} {ver} vLLM kernel tables: system {system}, table_vllm {table_vllm} (this project pins "
                f"vLLM {PINNED_VLLM}), model {Path(str(model)).name}, TP {tp}, dtype {dtype}; built "
                f"{dt.datetime.now(dt.UTC):%Y-%m-%d} by `mars profile --from-kernels`"),
    )
    return tables
