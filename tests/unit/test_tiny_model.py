"""Locally-made models: deterministic, real tokenizer, Hugging Face layout."""

from __future__ import annotations

import hashlib
import json

from app.clusters.tiny_model import make_model_config, make_tiny_model


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_deterministic_and_loadable(tmp_path):
    a, b = make_tiny_model(tmp_path / "a"), make_tiny_model(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(a / name) == digest(b / name)
    assert digest(make_tiny_model(tmp_path / "c", seed=1) / "model.safetensors") != digest(a / "model.safetensors")

    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    ids = tok("San Francisco is a city")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "San Francisco is a city"
    cfg = AutoConfig.from_pretrained(a)
    assert cfg.model_type == "llama" and cfg.vocab_size == len(tok)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_model_config_has_real_shapes_and_matching_vocab(tmp_path):
    out = make_model_config("llama-3.1-70b", tmp_path / "70b")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (8192, 80, 8)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == cfg["vocab_size"] == 128256
    assert sorted(vocab.values()) == list(range(128256))
    assert not (out / "model.safetensors").exists()
