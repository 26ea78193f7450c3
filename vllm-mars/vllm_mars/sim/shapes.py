"""Model shapes read from a Hugging Face ``config.json``, and the hardware they run on.

Pure arithmetic (no vllm, no torch): parameter counts, weight and KV bytes, FLOPs. Every count
follows the standard decoder layout (q/k/v/o projections, gated MLP of three matrices, RMSNorms
ignored as negligible); see docs/sim.md for the derivations.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: bytes per element of each weight/KV dtype the profiles accept
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
#: bits per expert weight of each expert-only quantisation a config.json may name (OCP MXFP4: 4-bit
#: elements with one 8-bit shared scale per 32-element block)
QUANT_EXPERT_BITS = {"mxfp4": 4.25}


@dataclass(frozen=True)
class Hardware:
    """One accelerator (per-GPU figures) and the tensor-parallel degree it runs at."""

    name: str
    #: dense BF16 peak, FLOP/s per GPU (spec sheet, no sparsity)
    peak_flops: float
    #: HBM bandwidth, bytes/s per GPU (spec sheet)
    hbm_bandwidth: float
    #: device memory, bytes per GPU, as the driver reports it (nvidia-smi / CUDA total)
    hbm_bytes: int
    #: tensor-parallel degree (GPUs the model is split over)
    tp: int = 1
    #: per-direction GPU-GPU bandwidth for the all-reduce term, bytes/s (NVLink); unused at tp=1
    interconnect_bandwidth: float = 450e9
    #: fixed latency of one all-reduce, seconds; unused at tp=1
    allreduce_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for f in ("peak_flops", "hbm_bandwidth", "hbm_bytes", "tp", "interconnect_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware.{f} must be > 0, got {getattr(self, f)!r}")
        if self.allreduce_latency_s < 0:
            raise ValueError(f"hardware.allreduce_latency_s must be >= 0, got {self.allreduce_latency_s!r}")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that set its step time and memory."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    #: routed experts per MoE layer (0: dense)
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    #: decoder layers whose MLP is a MoE block (all of them for Qwen3-MoE)
    moe_layers: int = 0
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2
    #: bits per expert weight when the experts are quantised apart from the rest (gpt-oss: MXFP4, 4-bit
    #: values plus one 8-bit scale per 32 = 4.25 bits); 0: the model dtype
    expert_bits: float = 0.0

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "dtype_bytes"):
            if not (isinstance(getattr(self, f), int) and getattr(self, f) > 0):
                raise ValueError(f"{f} must be a positive integer, got {getattr(self, f)!r}")
        if self.experts:
            if not 0 < self.experts_per_token <= self.experts or self.moe_intermediate <= 0:
                raise ValueError("a MoE model needs 0 < num_experts_per_tok <= num_experts and "
                                 "moe_intermediate_size > 0")
            if not 0 < self.moe_layers <= self.layers:
                raise ValueError(f"moe layers must be within 1..{self.layers}, got {self.moe_layers}")

    # -- parameters ---------------------------------------------------------------------------------
    @property
    def attn_params_per_layer(self) -> int:
        """q and o: hidden x heads*head_dim each; k and v: hidden x kv_heads*head_dim each."""
        return 2 * self.hidden * self.head_dim * (self.heads + self.kv_heads)

    @property
    def dense_mlp_params(self) -> int:
        """Gated MLP (gate, up, down) of one dense layer."""
        return 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        """One expert's gated MLP."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def embed_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab * self.hidden

    @property
    def shared_params(self) -> int:
        """Weights every token reads whatever the routing: attention, dense MLPs, routers (no embedding
        table, no lm_head)."""
        return (self.layers * self.attn_params_per_layer + self.dense_layers * self.dense_mlp_params
                + self.moe_layers * self.router_params)

    @property
    def total_params(self) -> int:
        return (self.shared_params + self.moe_layers * self.experts * self.expert_params
                + self.lm_head_params + self.embed_params)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass multiplies with (embedding lookup excluded)."""
        return (self.shared_params + self.moe_layers * self.experts_per_token * self.expert_params
                + self.lm_head_params)

    @property
    def expert_bytes_per_param(self) -> float:
        return self.expert_bits / 8 if self.expert_bits else float(self.dtype_bytes)

    @property
    def weight_bytes(self) -> int:
        experts = self.moe_layers * self.experts * self.expert_params
        return int((self.total_params - experts) * self.dtype_bytes + experts * self.expert_bytes_per_param)

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of every layer for one token, per GPU (KV heads split over TP, replicated below)."""
        return 2 * self.layers * max(1, -(-self.kv_heads // tp)) * self.head_dim * self.dtype_bytes

    # -- per-step counts ----------------------------------------------------------------------------
    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts of one MoE layer that ``tokens`` tokens route to (uniform routing):
        E * (1 - (1 - k/E)^T)."""
        if not self.experts or tokens <= 0:
            return 0.0
        return self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelShape:
        """From a Hugging Face config dict; ``where`` names the file in errors."""
        cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg

        def need(key: str) -> int:
            if key not in cfg:
                raise ValueError(f"{where}: missing field {key!r}")
            v = cfg[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{where}: field {key!r} must be a positive integer, got {v!r}")
            return v

        layers, hidden, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
        kv_heads = need("num_key_value_heads") if "num_key_value_heads" in cfg else heads
        head_dim = need("head_dim") if cfg.get("head_dim") else hidden // heads
        experts = next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if cfg.get(k)), 0)
        moe_layers = 0
        if experts:
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense_only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        quant = cfg.get("quantization_config") or {}
        quant = quant.get("quant_method") if isinstance(quant, dict) else None
        if quant not in (None, *QUANT_EXPERT_BITS):
            raise ValueError(f"{where}: quantization_config.quant_method {quant!r} not one of "
                             f"{sorted(QUANT_EXPERT_BITS)} (or none)")
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{where}: field 'torch_dtype' {dtype!r} not one of {sorted(DTYPE_BYTES)}")
        return cls(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   intermediate=need("intermediate_size") if (moe_layers < layers) else int(cfg.get("intermediate_size", 0)),
                   vocab=need("vocab_size"), experts=int(experts),
                   experts_per_token=need("num_experts_per_tok") if experts else 0,
                   # experts of intermediate_size where the config has no moe_intermediate_size (gpt-oss, Mixtral)
                   moe_intermediate=(need("moe_intermediate_size") if "moe_intermediate_size" in cfg
                                     else need("intermediate_size")) if experts else 0, moe_layers=moe_layers,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   dtype_bytes=DTYPE_BYTES[dtype], expert_bits=QUANT_EXPERT_BITS.get(quant, 0.0))

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> ModelShape:
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: not found (a model dir needs a config.json)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: expected a JSON object")  # noqa: TRY004
        return cls.from_config(cfg, str(path))
