"""The tiny model: offline, seeded, the same bytes every time, loadable by transformers."""

from __future__ import annotations

import json

import pytest
from vllm_mars.tiny_model import TinyModelSpec, build_tiny_model, model_digest


def test_same_bytes_every_time(tmp_path, tiny_model):
    again = build_tiny_model(tmp_path / "again")
    assert model_digest(again) == model_digest(tiny_model)
    cfg = json.loads((again / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (2, 128, 4096)


def test_tokenizer_has_a_chat_template_and_round_trips(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": "run the tests"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode("def hello(world): return 42")
    assert tok.decode(ids) == "def hello(world): return 42"
    assert tok.eos_token == "<|im_end|>"


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="hidden"):
        TinyModelSpec(hidden=100)
    with pytest.raises(ValueError, match="layers"):
        TinyModelSpec(layers=0)
