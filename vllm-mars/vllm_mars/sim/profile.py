"""Step-time profiles: one GPU (or CPU) x one model, for the virtual-time engine.

A profile is hardware (peak dense BF16 FLOP/s, HBM bandwidth and size, TP degree), a model shape
read from a config-only Hugging Face model dir, and a few efficiency coefficients fitted by
``mars profile`` (or priors, for GPUs nobody here has). It answers two questions:

- :meth:`Profile.step_seconds`: how long one engine step takes for the batch vLLM scheduled, as the
  roofline of its parts (linear layers; attention of each prefill chunk; attention of the decodes),
  each part ``max(FLOPs / (peak x efficiency), bytes / (bandwidth x bw_eff))``, plus a fixed
  per-step and a per-scheduled-request overhead, plus (TP > 1) two all-reduces per layer. A profile
  with overlapped CPU time (vLLM's async scheduling) takes ``max(that GPU time, the overlapped CPU
  time)`` plus the overheads (the shipped ``*-kernels`` profiles); one without (the roofline profiles)
  charges the overheads in series.
- :meth:`Profile.kv_capacity_tokens`: the KV pool vLLM would allocate:
  ``(CUDA-visible memory x gpu_memory_utilization - weights - activation peak - non-torch memory)
  / KV bytes per token`` (vLLM's ``determine_available_memory``).

A profile with ``kernels`` (:mod:`vllm_mars.sim.kernels`, ``mars profile --from-kernels``) prices
steps from NVIDIA's measured kernel tables instead of the roofline; the roofline coefficients stay
for a GPU or model the tables lack and for refits on a real GPU.

Files: TOML or JSON with the fields of :data:`_TOP` and the tables of :data:`_SECTIONS`; the shipped
ones live in ``profiles/`` beside this module (``available_profiles()``). No vllm or torch import. Formulas and sources:
docs/sim.md.

Over 450 lines on purpose: the profile's fields, the file schema that reads them and its writer are
one format that changes together (the kernel tables live in :mod:`~vllm_mars.sim.kernels`).
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

from vllm_mars.costmodel import CostModel
from vllm_mars.sim.kernels import KernelTables
from vllm_mars.sim.shapes import Hardware, ModelShape

PROFILES_DIR = Path(__file__).with_name("profiles")
MODELS_DIR = PROFILES_DIR / "models"
_SUFFIXES = (".toml", ".json")


@dataclass(frozen=True)
class Efficiency:
    """Fitted (or prior) coefficients of the roofline; shares of the hardware peaks and overheads."""

    #: share of peak FLOP/s the linear layers (dense and expert GEMMs, lm_head) reach
    mfu: float
    #: share of peak HBM bandwidth reached reading weights and KV
    bw_eff: float
    #: share of peak FLOP/s attention reaches (None: same as mfu)
    attn_mfu: float | None = None
    #: fixed cost of every step: scheduling, input preparation, sampling, launches (seconds)
    step_overhead_s: float = 0.0
    #: extra cost per request scheduled in the step (seconds)
    per_seq_overhead_s: float = 0.0
    #: CPU work of a step that runs while the GPU runs the step before it (vLLM's async scheduling:
    #: the next step is scheduled and its inputs prepared during this step's kernels), fixed and per
    #: scheduled request (seconds). A step takes ``max(GPU time, overlapped CPU time)`` plus the two
    #: overheads above (the part that does not overlap). 0 and 0: no overlap (synchronous scheduling)
    overlapped_step_s: float = 0.0
    overlapped_per_seq_s: float = 0.0
    #: where the numbers come from (prior with its source, or the `mars profile` fit and its error)
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("mfu", "bw_eff"):
            if not getattr(self, f) > 0:
                raise ValueError(f"efficiency.{f} must be > 0, got {getattr(self, f)!r}")
        if self.attn_mfu is not None and not self.attn_mfu > 0:
            raise ValueError(f"efficiency.attn_mfu must be > 0, got {self.attn_mfu!r}")
        for f in ("step_overhead_s", "per_seq_overhead_s", "overlapped_step_s", "overlapped_per_seq_s"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"efficiency.{f} must be >= 0, got {getattr(self, f)!r}")


@dataclass(frozen=True)
class StepTerms:
    """One step's work: the linear part and each attention part as (FLOPs, bytes), whole model."""

    n_seq: int
    tokens: int
    lin_flops: float
    lin_bytes: float
    #: (FLOPs, bytes) of each prefill chunk's attention, then of all decodes together
    attn: tuple[tuple[float, float], ...]
    #: seconds not scaled by any coefficient (the TP all-reduces)
    fixed_s: float


@dataclass(frozen=True)
class Profile:
    """One hardware x model step-time profile (the interface the sim engine and CostModel use)."""

    name: str
    #: shipped model name (a dir under profiles/models/) or a path to a config-only model dir
    model: str
    hardware: Hardware
    efficiency: Efficiency
    #: KV block size the sim engine uses (16 for GPU profiles, 32 for CPU)
    block_size: int = 16
    max_model_len: int = 32768
    #: vLLM engine defaults for that hardware (8192 / 1024 on H100/H200 for the OpenAI server)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    gpu_memory_utilization: float = 0.9
    #: peak activations and non-torch memory vLLM's profile run subtracts besides the weights (bytes)
    activation_reserve_bytes: int = 2 << 30
    #: memory CUDA lets the process use (``torch.cuda.mem_get_info()`` total, a little under nvidia-smi's
    #: figure); None: ``hardware.hbm_bytes``
    cuda_visible_bytes: int | None = None
    #: memory outside torch's allocator vLLM's profile run measures (CUDA context, cuBLAS workspace, NCCL)
    non_torch_bytes: int = 0
    #: explicit KV pool size (vLLM's kv_cache_memory_bytes); replaces the memory-based sizing
    kv_cache_memory_bytes: int | None = None
    #: explicit number of KV blocks (vLLM's num_gpu_blocks_override); wins over everything
    num_blocks: int | None = None
    description: str = ""
    #: measured-kernel step tables (``mars profile --from-kernels``); None: the roofline prices steps
    kernels: KernelTables | None = None
    #: directory relative model paths resolve against (the profile file's dir)
    base_dir: str = ""
    _k: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        for f in ("block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, f)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be within (0, 1], got {self.gpu_memory_utilization!r}")
        if self.non_torch_bytes < 0:
            raise ValueError(f"non_torch_bytes must be >= 0, got {self.non_torch_bytes!r}")
        if self.activation_reserve_bytes < 0:
            raise ValueError(f"activation_reserve_bytes must be >= 0, got {self.activation_reserve_bytes!r}")
        for f in ("kv_cache_memory_bytes", "num_blocks", "cuda_visible_bytes"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, int) and v > 0):
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        shape = ModelShape.from_model_dir(self.model_dir())
        self._k.update(_constants(shape, self.hardware, self.efficiency))
        self._k["shape"] = shape
        if self.num_kv_blocks() < 1:
            raise ValueError(f"profile {self.name}: the weights ({shape.weight_bytes / 2**30:.1f} GiB / TP "
                             f"{self.hardware.tp}) leave no KV memory")

    # -- the interface --------------------------------------------------------------------------------
    @property
    def shape(self) -> ModelShape:
        return self._k["shape"]

    def model_dir(self) -> str:
        """A config-only HF model dir (config.json), usable as ``ModelConfig(model=..., skip_tokenizer_init=True)``."""
        p = Path(self.model).expanduser()
        if not p.is_absolute() and self.base_dir and (Path(self.base_dir) / p / "config.json").exists():
            p = Path(self.base_dir) / p
        if (p / "config.json").exists():
            return str(p.resolve())
        shipped = MODELS_DIR / self.model
        if (shipped / "config.json").exists():
            return str(shipped)
        raise ValueError(f"profile {self.name}: model {self.model!r} is neither a dir with a config.json nor "
                         f"a shipped model ({', '.join(available_models())})")

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies on one GPU."""
        return self.shape.kv_bytes_per_token(self.hardware.tp)

    def kv_memory_bytes(self) -> int:
        """Bytes of the KV pool on one GPU, as vLLM's worker computes them (gpu_worker
        ``determine_available_memory``: requested memory - non-KV memory)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        weights = self.shape.weight_bytes / self.hardware.tp
        total = self.cuda_visible_bytes or self.hardware.hbm_bytes
        return int(total * self.gpu_memory_utilization - weights - self.activation_reserve_bytes - self.non_torch_bytes)

    def num_kv_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max(self.kv_memory_bytes(), 0) // (self.block_size * self.kv_bytes_per_token())

    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (whole blocks)."""
        return self.num_kv_blocks() * self.block_size

    def step_seconds(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        """Duration of one engine step.

        ``prefill``: (chunk_tokens, context_tokens_before_chunk) per prefilling request scheduled this
        step; ``decode``: context length (tokens already in KV) per decoding request. > 0 unless empty.
        """
        k = self._k
        n_seq = len(prefill) + len(decode)
        if n_seq == 0:
            return 0.0
        if self.kernels is not None:
            t = self.kernels.step_seconds(prefill, decode)
            if k["overlap"]:
                t = max(t, k["overlapped_step_s"] + k["overlapped_per_seq_s"] * n_seq)
            return t + k["step_overhead_s"] + k["per_seq_overhead_s"] * n_seq
        tokens = len(decode)
        t = 0.0
        for chunk, ctx in prefill:
            tokens += chunk
            # causal attention of the chunk over the context and itself; the KV of all of it is read once
            t += max(k["attn_flops"] * chunk * (ctx + (chunk + 1) / 2.0) * k["s_per_attn_flop"],
                     (ctx + chunk) * k["kv_bytes_s"])
        if decode:
            t += (sum(decode) + len(decode)) * k["decode_s_per_ctx"]
        bytes_ = k["lin_bytes"]
        if k["expert_bytes"]:
            bytes_ += k["expert_bytes"] * k["shape"].experts_touched(tokens)
        flops = k["lin_flops_per_token"] * tokens + k["head_flops_per_seq"] * n_seq
        t += max(flops * k["s_per_flop"], bytes_ * k["s_per_byte"])
        t += k["allreduce_s_per_token"] * tokens + k["allreduce_fixed_s"]
        if k["overlap"]:
            t = max(t, k["overlapped_step_s"] + k["overlapped_per_seq_s"] * n_seq)
        return t + k["step_overhead_s"] + k["per_seq_overhead_s"] * n_seq

    def step_terms(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> StepTerms:
        """The FLOPs and bytes behind :meth:`step_seconds`, part by part (what ``mars profile`` fits)."""
        k = self._k
        tokens = len(decode) + sum(c for c, _ in prefill)
        n_seq = len(prefill) + len(decode)
        kvb = k["kv_bytes_s"] / k["s_per_byte"]
        attn = [(k["attn_flops"] * c * (ctx + (c + 1) / 2.0), (ctx + c) * kvb) for c, ctx in prefill]
        if decode:
            ctx = sum(decode) + len(decode)
            attn.append((k["attn_flops"] * ctx, ctx * kvb))
        lin_bytes = k["lin_bytes"] + k["expert_bytes"] * self.shape.experts_touched(tokens)
        return StepTerms(n_seq=n_seq, tokens=tokens,
                         lin_flops=k["lin_flops_per_token"] * tokens + k["head_flops_per_seq"] * n_seq,
                         lin_bytes=lin_bytes, attn=tuple(attn),
                         fixed_s=(k["allreduce_s_per_token"] * tokens + k["allreduce_fixed_s"]) if n_seq else 0.0)

    def with_efficiency(self, efficiency: Efficiency, **changes: Any) -> Profile:
        """A copy with other coefficients (and any other field changed)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        kw.update(changes, efficiency=efficiency)
        return Profile(**kw)

    def with_step_scale(self, factor: float) -> Profile:
        """The same engine ``factor`` times slower (< 1: faster): every step takes ``factor`` x its
        time here (peak rates / factor, latencies and overheads x factor); the KV pool and the
        engine limits stay. For asking how a result depends on the step speed, e.g. the CPU
        engine on a quiet box against one whose steps a busy host slows."""
        if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor < math.inf):
            raise ValueError(f"step scale must be a positive number, got {factor!r}")
        hw, e = self.hardware, self.efficiency
        scaled_hw = replace(hw, peak_flops=hw.peak_flops / factor, hbm_bandwidth=hw.hbm_bandwidth / factor,
                            interconnect_bandwidth=hw.interconnect_bandwidth / factor,
                            allreduce_latency_s=hw.allreduce_latency_s * factor)
        eff = replace(e, step_overhead_s=e.step_overhead_s * factor, per_seq_overhead_s=e.per_seq_overhead_s * factor,
                      overlapped_step_s=e.overlapped_step_s * factor,
                      overlapped_per_seq_s=e.overlapped_per_seq_s * factor,
                      source=f"{e.source}; step times x {factor:g}".lstrip("; "))
        # The KV pool is what the unscaled hardware holds (bytes are not time).
        kernels = self.kernels.scaled(factor) if self.kernels is not None else None
        return self.with_efficiency(eff, hardware=scaled_hw, name=f"{self.name}-x{factor:g}",
                                    num_blocks=self.num_kv_blocks(), kernels=kernels)

    @classmethod
    def from_kernels(cls, gpu: str, model: str, *, tp: int = 1, dtype: str = "auto", name: str | None = None,
                     max_model_len: int | None = None, scheduling: str | None = None) -> Profile:
        """A profile whose steps come from aiconfigurator-core's vLLM kernel tables (needs the
        ``kernels`` extra): ``gpu`` one of :data:`~vllm_mars.sim.kernels.GPUS`, ``model`` a shipped
        model name or a config-only model dir. KV memory as vLLM sizes it (CUDA-visible memory x 0.9
        - weights - the model class's activation peak - non-torch memory); ``max_model_len`` (default)
        the largest power of two the pool holds, at most the model's ``max_position_embeddings``.
        ``scheduling``: ``async`` (vLLM's async scheduling: that CPU work overlaps the kernels;
        :data:`~vllm_mars.sim.kernels.ASYNC_OVERHEAD_SOURCE`) or ``sync`` (the CPU overheads between
        steps); default (None) what the pinned vLLM runs, :data:`~vllm_mars.sim.kernels.DEFAULT_SCHEDULING`.
        The default name is ``GPU-MODEL[-tpN]-kernels``, with ``-sync`` or ``-async`` added when the
        scheduling is not the default."""
        from vllm_mars.sim import kernels as kn

        scheduling = kn.DEFAULT_SCHEDULING if scheduling is None else scheduling
        if scheduling not in kn.SCHEDULING:
            raise ValueError(f"scheduling {scheduling!r}: not one of {', '.join(kn.SCHEDULING)}")
        g = gpu.lower()
        if g not in kn.GPUS:
            raise ValueError(f"GPU {gpu!r}: not one of {', '.join(sorted(kn.GPUS))}")
        model_dir = Path(model) if (Path(model) / "config.json").exists() else MODELS_DIR / model
        if not (model_dir / "config.json").exists():
            raise ValueError(f"model {model!r}: neither a dir with a config.json nor a shipped model "
                             f"({', '.join(available_models())})")
        cfg = json.loads((model_dir / "config.json").read_text())
        arch = (cfg.get("architectures") or ["?"])[0]
        label, peak, bw, smi, link = kn.GPUS[g]
        hw = Hardware(name=label, peak_flops=peak, hbm_bandwidth=bw, hbm_bytes=smi, tp=tp, interconnect_bandwidth=link)
        act, non_torch = kn.memory_of(arch, tp)
        # roofline coefficients kept for a refit or a fallback: the shipped priors (docs/sim.md)
        eff = Efficiency(mfu=0.5, bw_eff=0.65, attn_mfu=0.45, step_overhead_s=kn.STEP_OVERHEAD_S,
                         per_seq_overhead_s=kn.PER_SEQ_OVERHEAD_S,
                         source=f"step and request overheads fitted once ({kn.OVERHEAD_SOURCE}); roofline "
                                "coefficients are priors, unused while the kernel tables price the steps")
        if scheduling == "async":
            eff = replace(eff, overlapped_step_s=kn.STEP_OVERHEAD_S, overlapped_per_seq_s=kn.PER_SEQ_OVERHEAD_S,
                          step_overhead_s=kn.ASYNC_STEP_OVERHEAD_S, per_seq_overhead_s=kn.ASYNC_PER_SEQ_OVERHEAD_S,
                          source=f"async scheduling: the step and request overheads ({kn.OVERHEAD_SOURCE}) overlap "
                                 f"the kernels, the non-overlapped rest fitted once ({kn.ASYNC_OVERHEAD_SOURCE}); "
                                 "roofline coefficients are priors, unused while the kernel tables price the steps")
        shipped = model_dir.parent == MODELS_DIR
        name = name or f"{g}-{model_dir.name}{f'-tp{tp}' if tp > 1 else ''}-kernels{'' if scheduling == kn.DEFAULT_SCHEDULING else f'-{scheduling}'}"
        kw: dict[str, Any] = {"name": name, "model": model_dir.name if shipped else str(model_dir.resolve()),
                              "hardware": hw, "efficiency": eff, "cuda_visible_bytes": kn.cuda_visible_bytes(g),
                              "activation_reserve_bytes": act, "non_torch_bytes": non_torch}
        if max_model_len is None:
            probe = cls(max_model_len=16, **kw)
            limit = int(cfg.get("max_position_embeddings") or 131072)
            pool = probe.kv_capacity_tokens()
            if pool < 16:
                raise ValueError(f"{name}: the weights leave no KV memory")
            max_model_len = min(1 << (pool.bit_length() - 1), limit)
        tables = kn.build_tables(g, model_dir, tp=tp, dtype=dtype, max_model_len=max_model_len,
                                 max_num_batched_tokens=8192, max_num_seqs=1024)
        desc = (f"{model_dir.name} ({arch}) on {label}, TP {tp}: step times from measured vLLM kernels "
                f"({tables.source}){'; async scheduling (CPU work overlaps the kernels)' if scheduling == 'async' else ''}")
        return cls(max_model_len=max_model_len, kernels=tables, description=desc, **kw)

    def cost_model(self) -> CostModel:
        """The policies' :class:`~vllm_mars.costmodel.CostModel` of this profile: least squares on
        its own :meth:`step_seconds` (single-chunk prefill steps over the step budget and contexts up
        to ``max_model_len``, and single-decode steps)."""
        return CostModel.fit_steps(self.step_seconds, budget=self.max_num_batched_tokens,
                                   max_len=self.max_model_len, source=f"fitted to step-time profile {self.name!r}")

    # -- files ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The file form (what :func:`load_profile` reads back)."""
        d: dict[str, Any] = {"name": self.name, "description": self.description, "model": self.model}
        for f in ("block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            d[f] = getattr(self, f)
        d["hardware"] = asdict(self.hardware)
        mem = {"gpu_memory_utilization": self.gpu_memory_utilization, "cuda_visible_bytes": self.cuda_visible_bytes,
               "activation_reserve_bytes": self.activation_reserve_bytes,
               "non_torch_bytes": self.non_torch_bytes or None,
               "kv_cache_memory_bytes": self.kv_cache_memory_bytes, "num_blocks": self.num_blocks}
        d["memory"] = {k: v for k, v in mem.items() if v is not None}
        # the overlap fields only where set: a profile without overlap writes the file it always wrote
        d["efficiency"] = {k: v for k, v in asdict(self.efficiency).items()
                           if v is not None and not (k.startswith("overlapped_") and v == 0)}
        if self.kernels is not None:
            d["kernels"] = self.kernels.to_dict()
        return d

    def write(self, path: str | Path) -> Path:
        """Write as JSON (``.json``) or TOML (anything else)."""
        path = Path(path)
        if self.kernels is not None and path.suffix != ".json":
            raise ValueError(f"{path}: a profile with kernel tables is written as .json")
        d = self.to_dict()
        path.write_text(json.dumps(d, indent=2) + "\n" if path.suffix == ".json" else _toml(d))
        return path


def _constants(shape: ModelShape, hw: Hardware, eff: Efficiency) -> dict[str, float]:
    """Per-step constants of the formula, precomputed so step_seconds stays a few multiplications."""
    tp, b = hw.tp, shape.dtype_bytes
    s_per_flop = 1.0 / (hw.peak_flops * tp * eff.mfu)
    s_per_attn_flop = 1.0 / (hw.peak_flops * tp * (eff.attn_mfu or eff.mfu))
    s_per_byte = 1.0 / (hw.hbm_bandwidth * tp * eff.bw_eff)
    # attention FLOPs per (query, key) pair over all layers: QK^T and PV, 2 FLOPs per multiply-add
    attn_flops = 4.0 * shape.layers * shape.heads * shape.head_dim
    kv_bytes = shape.kv_bytes_per_token(1)  # the whole model's KV; split over TP by s_per_byte
    # a decode is a 1-token chunk: its part is max(compute, memory) per context token, linear in L+1
    decode_s_per_ctx = max(attn_flops * s_per_attn_flop, kv_bytes * s_per_byte)
    # two all-reduces (attention out, MLP out) per layer of tokens x hidden activations, ring algorithm
    ar = 2 * shape.layers if tp > 1 else 0
    return dict(  # noqa: C408 (keyword form reads better here)
        s_per_flop=s_per_flop, s_per_attn_flop=s_per_attn_flop, s_per_byte=s_per_byte,
        attn_flops=attn_flops, kv_bytes_s=kv_bytes * s_per_byte, decode_s_per_ctx=decode_s_per_ctx,
        lin_flops_per_token=2.0 * (shape.active_params - shape.lm_head_params),
        head_flops_per_seq=2.0 * shape.lm_head_params,
        lin_bytes=float((shape.shared_params + shape.lm_head_params) * b),
        expert_bytes=float(shape.moe_layers * shape.expert_params * shape.expert_bytes_per_param),
        allreduce_s_per_token=ar * 2.0 * (tp - 1) / tp * shape.hidden * b / hw.interconnect_bandwidth,
        allreduce_fixed_s=ar * hw.allreduce_latency_s,
        step_overhead_s=eff.step_overhead_s, per_seq_overhead_s=eff.per_seq_overhead_s,
        overlapped_step_s=eff.overlapped_step_s, overlapped_per_seq_s=eff.overlapped_per_seq_s,
        overlap=bool(eff.overlapped_step_s or eff.overlapped_per_seq_s),
    )


# -- loading and validation ---------------------------------------------------------------------------
_TOP = {"name": str, "description": str, "model": str, "block_size": int, "max_model_len": int,
        "max_num_batched_tokens": int, "max_num_seqs": int}
_SECTIONS = {
    "hardware": {f.name: f.type for f in fields(Hardware)},
    "memory": {"gpu_memory_utilization": "float", "activation_reserve_bytes": "int", "cuda_visible_bytes": "int",
               "non_torch_bytes": "int",
               "kv_cache_memory_bytes": "int", "num_blocks": "int"},
    "efficiency": {f.name: f.type for f in fields(Efficiency)},
}
_REQUIRED = {"top": ("name", "model"), "hardware": ("name", "peak_flops", "hbm_bandwidth", "hbm_bytes"),
             "efficiency": ("mfu", "bw_eff")}


def _check_type(where: str, key: str, value: Any, typ: Any) -> Any:
    typ = typ if isinstance(typ, str) else typ.__name__
    base = typ.split("|")[0].strip()
    if base == "str":
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: field {key!r} must be a number, got {value!r}")  # noqa: TRY004 (CLI: exit 2)
    if base == "int":
        if value != int(value):
            raise ValueError(f"{where}: field {key!r} must be an integer, got {value!r}")
        return int(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: field {key!r} must be finite, got {value!r}")
    return float(value)


def profile_from_dict(d: Mapping[str, Any], where: str, base_dir: str = "") -> Profile:
    """Validate a profile mapping; every error is one line naming ``where`` and the field."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: expected a table/object at top level")  # noqa: TRY004
    known = set(_TOP) | set(_SECTIONS) | {"kernels"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    top = {}
    for key in _REQUIRED["top"]:
        if key not in d:
            raise ValueError(f"{where}: missing field {key!r}")
    for key, typ in _TOP.items():
        if key in d:
            top[key] = _check_type(where, key, d[key], typ)
    parts: dict[str, dict[str, Any]] = {}
    for sec, schema in _SECTIONS.items():
        raw = d.get(sec, {})
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: field {sec!r} must be a table/object")  # noqa: TRY004
        bad = sorted(set(raw) - set(schema))
        if bad:
            raise ValueError(f"{where}: unknown field '{sec}.{bad[0]}' (known: {', '.join(sorted(schema))})")
        for key in _REQUIRED.get(sec, ()):
            if key not in raw:
                raise ValueError(f"{where}: missing field '{sec}.{key}'")
        parts[sec] = {k: _check_type(where, f"{sec}.{k}", v, schema[k]) for k, v in raw.items() if v is not None}
    kernels = KernelTables.from_dict(d["kernels"], where) if "kernels" in d else None
    try:
        hw = Hardware(**parts["hardware"])
        eff = Efficiency(**parts["efficiency"])
        return Profile(hardware=hw, efficiency=eff, base_dir=base_dir, kernels=kernels, **top, **parts["memory"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _read(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None


def available_profiles() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(p.stem for p in PROFILES_DIR.iterdir() if p.suffix in _SUFFIXES)


def available_models() -> list[str]:
    """Names of the shipped config-only model dirs."""
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").exists())


@cache
def _load_path(path: str, mtime: float) -> Profile:
    p = Path(path)
    return profile_from_dict(_read(p), str(p), base_dir=str(p.parent))


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a ``.toml``/``.json`` profile file.

    ValueError (one line) names the valid profiles for an unknown name, or the file and field for a
    malformed file.
    """
    p = Path(name_or_path).expanduser()
    if not p.is_file():
        shipped = [PROFILES_DIR / f"{name_or_path}{s}" for s in _SUFFIXES]
        found = [s for s in shipped if s.is_file()]
        if not found:
            raise ValueError(f"unknown profile {name_or_path!r}: not a file and not one of "
                             f"{', '.join(available_profiles())}")
        p = found[0]
    return _load_path(str(p.resolve()), p.stat().st_mtime)


def load_cost_model(name_or_path: str) -> CostModel:
    """A cost model from a file: a serialised :class:`CostModel` (JSON with ``prefill_s_per_token``)
    or a step-time profile (shipped name or file; :meth:`Profile.cost_model`)."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.is_file():
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{name_or_path}:{e.lineno}: not JSON: {e.msg}") from None
        if isinstance(d, dict) and "prefill_s_per_token" in d:
            return CostModel.from_dict(d, where=str(name_or_path))
    return load_profile(name_or_path).cost_model()


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))


def _toml(d: Mapping[str, Any]) -> str:
    """Minimal TOML writer for the profile's flat tables (no arrays, no nesting below sections)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if not isinstance(v, Mapping)]
    for k, v in d.items():
        if isinstance(v, Mapping):
            lines += ["", f"[{k}]", *(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())]
    return "\n".join(lines) + "\n"
