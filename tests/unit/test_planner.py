"""Capacity planner: parameter counts, the seed workshop's tables, GPU budgets and suggested layouts."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from app.cli import main
from app.plan import planner
from app.plan.planner import GiB, kv_bytes, load_shape, parse_tokens, plan, workshop_weight_table

QWEN2_7B = {  # shapes of Qwen2-7B's published config.json: GQA 28/4 heads, q/k/v biases, 152k vocabulary
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B = {  # Mistral-7B-v0.1: no head_dim key, 32k vocabulary
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
}


def test_module_is_pure():
    code = "import sys, app.plan.planner; assert not {'ray', 'vllm', 'torch'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("preset", "billions"), [("8b", 8.03), ("70b", 70.55), ("405b", 405.85)])
def test_parameter_counts_from_shapes(preset, billions):
    assert round(load_shape(preset).params / 1e9, 2) == billions


def test_non_preset_shapes_count_like_their_model_cards():
    assert load_shape("qwen2-7b", QWEN2_7B).params == 7_615_616_512  # with q/k/v biases
    assert load_shape("mistral-7b", MISTRAL_7B).params == 7_241_732_096
    assert load_shape("qwen2-7b", QWEN2_7B).kv_bytes_per_token() == 28 * 2 * 4 * 128 * 2
    tied = load_shape("tied", {**MISTRAL_7B, "tie_word_embeddings": True})
    assert load_shape("m", MISTRAL_7B).params - tied.params == 32000 * 4096


def test_config_without_required_keys_is_named():
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        load_shape("x", {k: v for k, v in MISTRAL_7B.items() if k != "intermediate_size"})


def test_workshop_weight_table_nominal_gb():
    table = workshop_weight_table()
    assert table["llama-3.1-8b"] == {"fp16": 16, "fp8": 8, "int4": 4}
    assert table["llama-3.1-70b"] == {"fp16": 140, "fp8": 70, "int4": 35}
    assert table["llama-3.1-405b"]["fp16"] == 810 and table["llama-3.1-405b"]["fp8"] == 405
    assert table["llama-3.1-405b"]["int4"] == pytest.approx(202.5)  # the table rounds it to 203


def test_exact_weights_keep_embeddings_16_bit_when_quantized():
    shape = load_shape("405b")
    assert planner.weight_bytes(shape, "bf16") == pytest.approx(shape.params * 2)
    fp8 = planner.weight_bytes(shape, "fp8")
    assert shape.params < fp8 < shape.params * 1.03  # lm_head + embeddings stay bf16


@pytest.mark.parametrize(
    ("preset", "kib", "gib_128k", "gib_131072"),
    [
        ("8b", 128, 15.62, 16.0),
        ("70b", 320, 39.06, 40.0),
        ("405b", 504, 61.52, 63.0),
    ],
)
def test_kv_cache_per_token_and_per_context(preset, kib, gib_128k, gib_131072):
    shape = load_shape(preset)
    assert shape.kv_bytes_per_token("bf16") == kib * 1024
    assert round(kv_bytes(shape, 128_000) / GiB, 2) == gib_128k
    assert kv_bytes(shape, 131_072) / GiB == gib_131072
    assert kv_bytes(shape, 128_000, "fp8") * 2 == kv_bytes(shape, 128_000)


def test_workshop_405b_kv_is_twice_the_real_figure():
    shape = load_shape("405b")
    doubled = shape.num_layers * 2 * (2 * shape.num_kv_heads) * shape.head_dim * 2 * 128_000
    assert round(doubled / GiB, 2) == 123.05  # the workshop's number: 16 KV heads instead of 8
    assert round(kv_bytes(shape, 128_000) / GiB, 1) == 61.5


@pytest.mark.parametrize(
    ("preset", "gpu", "dtype", "layout"),
    [
        ("8b", "h100-80gb", "bf16", (1, 1, 1)),
        ("70b", "h100-80gb", "bf16", (4, 1, 1)),
        ("70b", "h200-141gb", "bf16", (2, 1, 1)),
        ("70b", "a100-40gb", "bf16", (8, 1, 1)),
        ("405b", "h100-80gb", "bf16", (8, 2, 2)),
        ("405b", "h100-80gb", "fp8", (8, 1, 1)),
        ("405b", "h200-141gb", "bf16", (8, 1, 1)),
    ],
)
def test_suggested_layouts_at_full_context(preset, gpu, dtype, layout):
    p = plan(load_shape(preset), gpu, 131_072, dtype)
    assert (p.layout.tp, p.layout.pp, p.layout.nodes) == layout
    assert p.layout_usage.shortfall == 0


def test_gpus_needed_is_a_memory_lower_bound():
    assert plan(load_shape("8b"), "h100-80gb", 128_000).gpus_needed == 1
    assert plan(load_shape("70b"), "h100-80gb", 128_000).gpus_needed == 3  # workshop: 2.24 H100s
    assert plan(load_shape("405b"), "h100-80gb", 128_000).gpus_needed == 12  # workshop: 11.66 H100s


def test_tp_sizes_divide_heads():
    assert planner.valid_tp_sizes(load_shape("qwen2-7b", QWEN2_7B), 8) == [1, 2, 4]  # 28 heads
    assert planner.valid_tp_sizes(load_shape("70b"), 8) == [1, 2, 4, 8]


def test_headroom_is_inside_the_utilization_budget():
    budget = planner.Budget("h100-80gb")
    shape = load_shape("8b")
    # by hand, for Llama 3.1 8B (hidden 4096, MLP 14336, vocabulary 128256) at vLLM's defaults on an H100 (81,559 MiB)
    # activations 8,192 tokens x (4,096 + 2 x 14,336) x 2 B = 536,870,912; logits 256 seqs x 128,256 x 4 B =
    # 131,334,144; fixed 1.5 GiB = 1,610,612,736: headroom 2,278,817,792 B;
    # room = floor(85,520,809,984 B x 0.9) - headroom = 76,968,728,985 - 2,278,817,792
    assert budget.headroom(shape, 1) == 2_278_817_792
    assert budget.room(shape, 1) == 74_689_911_193
    assert budget.headroom(shape, 8) < budget.headroom(shape, 1)  # activations shard with TP


def test_parse_tokens():
    assert parse_tokens("128k") == 128_000 and parse_tokens("128Ki") == 131_072
    assert parse_tokens("131072") == parse_tokens("131,072") == 131_072


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    ("model", "rows"),
    [
        (
            "llama-3.1-8b",
            [
                "8.03 B (nominal 8 B)",
                "16.1 GB",
                "128 KiB",
                "15.62 GiB",
                "TP 1 × PP 1 = 1 GPU on 1 node",
                "8 replicas × TP 1 per 8-GPU node",
            ],
        ),
        (
            "70b",
            [
                "70.55 B (nominal 70 B)",
                "141.1 GB",
                "320 KiB",
                "39.06 GiB",
                "TP 4 × PP 1 = 4 GPUs on 1 node",
                "2 replicas × TP 4",
            ],
        ),
        (
            "405b",
            [
                "405.85 B (nominal 405 B)",
                "811.7 GB",
                "504 KiB",
                "61.52 GiB",
                "12 (weights + KV of one 128,000-token sequence)",
                "TP 8 × PP 2 = 16 GPUs on 2 nodes",
            ],
        ),
    ],
)
def test_summit_plan_presets(capsys, model, rows):
    rc, out, _ = run_cli(capsys, "plan", "--model", model, "--gpu", "h100-80gb", "--context", "128k", "--dtype", "bf16")
    assert rc == 0
    for row in rows:
        assert row in out, (row, out)
    for key in ("weights (bf16)", "KV per token", "headroom per GPU", "GPUs needed", "suggested"):
        assert key in out


def test_summit_plan_non_preset_config_json(capsys, tmp_path):
    (tmp_path / "qwen2-7b").mkdir()
    (tmp_path / "qwen2-7b/config.json").write_text(json.dumps(QWEN2_7B))
    rc, out, _ = run_cli(
        capsys, "plan", "--model", str(tmp_path / "qwen2-7b"), "--gpu", "a100-40gb", "--context", "32768"
    )
    assert rc == 0
    assert "qwen2-7b: 28 layers" in out and "7.62 B" in out and "56 KiB" in out and "1.75 GiB" in out
    assert "TP 1 × PP 1" in out and "fits one GPU" in out
    path = tmp_path / "mistral.json"
    path.write_text(json.dumps(MISTRAL_7B))
    rc, out, _ = run_cli(
        capsys, "plan", "--model", str(path), "--gpu", "h100-80gb", "--dtype", "int4", "--kv-dtype", "fp8"
    )
    assert rc == 0 and "7.24 B" in out and re.search(r"KV per token \(fp8\) +64 KiB", out)


def test_summit_plan_errors_are_named(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "plan", "--model", "llama-9b", "--gpu", "h100-80gb")
    assert rc == 2 and "unknown model preset 'llama-9b'" in err
    rc, _, err = run_cli(capsys, "plan", "--model", str(tmp_path / "none.json"), "--gpu", "h100-80gb")
    assert rc == 2 and "no such config.json" in err


def test_the_sizing_page_shows_current_plan_output(capsys):
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "docs/configuration/sizing.md").read_text()
    for model in ("8b", "70b", "405b"):
        argv = ["plan", "--model", model, "--gpu", "h100-80gb", "--context", "128k", "--dtype", "bf16"]
        _, out, _ = run_cli(capsys, *argv)
        assert f"$ summit {' '.join(argv)}\n{out}" in readme, f"docs/configuration/sizing.md: {model}'s output is stale"


def test_a_mixture_of_experts_counts_every_expert_in_memory_and_its_chosen_ones_as_active():
    """Mixtral 8x7B's config: 46.7 B parameters held, 12.9 B run per token (Mistral AI's own figures)."""
    from app.plan.planner import ModelShape

    cfg = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "model_type": "mixtral",
    }
    moe = ModelShape.from_config(cfg, "mixtral-8x7b")
    assert round(moe.params / 1e9, 1) == 46.7 and round(moe.active_params / 1e9, 1) == 12.9
    dense = ModelShape.from_config({k: v for k, v in cfg.items() if "expert" not in k}, "mistral-7b")
    assert dense.active_params == dense.params and round(dense.params / 1e9, 2) == 7.24


def test_the_tiny_architectures_have_their_familys_shapes(tmp_path):
    import json

    from app.clusters.tiny_model import make_tiny_model
    from app.plan.planner import ModelShape

    shapes = {
        arch: ModelShape.from_config(
            json.loads((make_tiny_model(tmp_path / arch, arch=arch) / "config.json").read_text())
        )
        for arch in ("llama", "qwen2", "mixtral")
    }
    assert shapes["qwen2"].qkv_bias and not shapes["llama"].qkv_bias
    assert shapes["mixtral"].num_experts == 4 and shapes["mixtral"].active_params < shapes["mixtral"].params
    from safetensors import safe_open

    with safe_open(str(tmp_path / "mixtral" / "model.safetensors"), "pt") as f:  # the weights have those shapes
        assert sum(f.get_tensor(k).numel() for k in f.keys()) == shapes["mixtral"].params
