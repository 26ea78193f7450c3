"""A tiny random-weight Qwen3 model and an offline tokenizer, built locally and reproducibly.

Tests and CPU demos need a real model that vLLM can load without a network. The weights are
seeded random numbers (the outputs are gibberish; lengths, KV use and scheduling are real). The
tokenizer is a byte-level BPE trained on a corpus generated here from a fixed seed, so every
machine gets the same bytes.

torch, transformers and tokenizers are imported only to build a missing model: ``mars --help``
imports this module and must not import torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# CPU attention supports head sizes 32..512 in steps; 64 keeps KV at 512 B/token for the default.
HEAD_DIM = 64
_WORDS = (  # noqa: SIM905  (a sentence reads and edits better than 100 quoted words)
    "def class return import from self None True False if else elif for while in not and or "
    "with as try except finally raise yield lambda async await pass break continue print len "
    "range list dict set tuple str int float open read write file path tool call agent turn "
    "session workflow prompt token cache block memory schedule request model output input "
    "error test assert value result config data json shell bash grep edit patch diff commit "
    "the a of to is it that this be on at by an we you they run build make install update"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. Defaults: 2 layers, hidden 128, vocab 4096 (0.8 M parameters)."""

    layers: int = 2
    hidden: int = 128
    vocab: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")
        if self.hidden < HEAD_DIM or self.hidden % HEAD_DIM:
            raise ValueError(f"hidden must be a positive multiple of {HEAD_DIM}, got {self.hidden}")
        if not 512 <= self.vocab <= 65536:
            raise ValueError(f"vocab must be within [512, 65536], got {self.vocab}")

    @property
    def name(self) -> str:
        return f"tiny-qwen3-l{self.layers}-h{self.hidden}-v{self.vocab}-s{self.seed}"


def default_cache_root() -> Path:
    env = os.environ.get("MARS_CACHE_DIR")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("vllm-mars"))


def default_model_dir(spec: TinyModelSpec | None = None) -> Path:
    return default_cache_root() / "models" / (spec or TinyModelSpec()).name


def qwen3_config_dict(spec: TinyModelSpec, eos_token_id: int = 2, pad_token_id: int = 0) -> dict:
    """The HF config.json of the tiny model; enough on its own for vLLM's ModelConfig."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.hidden * 2,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.hidden // HEAD_DIM,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
    }


def write_config_only(out_dir: str | os.PathLike, spec: TinyModelSpec | None = None) -> Path:
    """A model dir holding only config.json: what the standalone scheduler rig needs (no torch)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(qwen3_config_dict(spec or TinyModelSpec()), indent=2))
    return out


def _corpus(seed: int, lines: int = 20000) -> list[str]:
    rng = random.Random(seed)
    # Pseudo-words from syllables, drawn Zipf-like, give BPE enough distinct merges for any vocab.
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "ch", "sh", "qu", "x"]
    lexicon = list(_WORDS) + ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                              for _ in range(6000)]
    weights = [1.0 / (k + 1) for k in range(len(lexicon))]
    out = []
    for i in range(lines):
        n = rng.randint(3, 14)
        words = rng.choices(lexicon, weights, k=n)
        if i % 3 == 0:
            words.insert(rng.randint(0, n), f"x{rng.randint(0, 999)}")
        sep = rng.choice((" ", " ", "_", ".", ", "))
        indent = "    " * rng.randint(0, 2)
        out.append(indent + sep.join(words) + rng.choice(("", ":", "()", " = 0", "\n")))
    return out


def _build_tokenizer(spec: TinyModelSpec, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)
    return hf


def build_tiny_model(out_dir: str | os.PathLike | None = None, spec: TinyModelSpec | None = None,
                     force: bool = False) -> Path:
    """Build (or reuse) the tiny model at ``out_dir`` (default: the user cache dir). Returns the dir.

    The directory is written to a temporary sibling and renamed, so a crash never leaves a half
    model that later runs would mistake for a finished one.
    """
    spec = spec or TinyModelSpec()
    out = Path(out_dir) if out_dir is not None else default_model_dir(spec)
    marker = out / ".mars-tiny-model.json"
    if marker.exists() and not force:
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf_tok = _build_tokenizer(spec, tmp)
        eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
        pad = hf_tok.pad_token_id
        cfg_dict = qwen3_config_dict(spec, eos_token_id=eos, pad_token_id=pad)
        cfg_dict["vocab_size"] = len(hf_tok)
        cfg = Qwen3Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
        cfg.architectures = ["Qwen3ForCausalLM"]
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos, "pad_token_id": pad}, indent=2))
        (tmp / ".mars-tiny-model.json").write_text(json.dumps({"spec": spec.__dict__}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def model_digest(model_dir: str | os.PathLike) -> str:
    """sha256 over the files of a model dir (names and bytes), for reproducibility checks."""
    h = hashlib.sha256()
    root = Path(model_dir)
    for p in sorted(root.iterdir()):
        if p.is_file() and not p.name.startswith(".mars"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()
