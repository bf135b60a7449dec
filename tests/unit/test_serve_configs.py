"""Every shipped Serve YAML validates, and `summit validate` accepts each on its hardware and refuses what cannot
fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.build.engine_checks import load_config
from app.cli import main
from app.config import SummitConfig
from app.plan.validate import Hardware, validate_doc, validate_file
from tests.unit.test_config import _FakeRay

CONFIGS = Path(__file__).parents[2] / "serve_configs"
GPU_CONFIGS = {  # file → the hardware it is written for: (gpu, gpus per node, nodes)
    "llama8b.yaml": ("h100-80gb", 8, 1),
    "llama70b.yaml": ("h100-80gb", 8, 1),
    "llama405b.yaml": ("h100-80gb", 8, 2),
    "llama405b-fp8.yaml": ("h100-80gb", 8, 1),
    "llama8b-fp8.yaml": ("h100-80gb", 8, 1),
    "llama70b-fp8.yaml": ("h100-80gb", 8, 1),
    "llama405b-fp8-4gpu.yaml": ("h200-141gb", 4, 1),
}


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def with_model(doc: dict, **changes) -> dict:
    model = {**doc["applications"][0]["args"]["models"][0], **changes}
    app = {**doc["applications"][0], "args": {**doc["applications"][0]["args"], "models": [model]}}
    return {**doc, "applications": [app]}


def with_engine(doc: dict, **changes) -> dict:
    model = doc["applications"][0]["args"]["models"][0]
    return with_model(doc, engine_kwargs={**model["engine_kwargs"], **changes})


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_serve_config_validates(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["http_options"]["host"] == "127.0.0.1"
    for app in doc["applications"]:
        assert app["import_path"] == "app.build:build_app"
        load_config(app["args"])


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_use_token_auth_an_env_var_path_and_a_preset(name):
    doc = load(name)
    app = doc["applications"][0]
    assert app["runtime_env"]["env_vars"]["RAY_AUTH_MODE"] == "token"
    model = app["args"]["models"][0]
    assert model["source"].startswith("${LLAMA") and ":-/models/" in model["source"]
    assert model["model_preset"].startswith("llama-3.1-") and model["accelerator"] == "gpu"
    # the switch to dummy weights is documented, as the environment override
    assert 'SUMMIT_ENGINE_KWARGS=\'{"load_format": "dummy"}\'' in (CONFIGS / name).read_text()


@pytest.mark.parametrize(("name", "hardware"), sorted(GPU_CONFIGS.items()))
def test_summit_validate_accepts_each_config_on_its_hardware(name, hardware):
    report = validate_file(CONFIGS / name, Hardware(*hardware), env={})
    assert report.ok, report.problems


def test_intended_layouts():
    m = {n: SummitConfig.model_validate(load(n)["applications"][0]["args"]).models[0] for n in GPU_CONFIGS}
    layout = {n: (x.tensor_parallel_size, x.pipeline_parallel_size) for n, x in m.items()}
    assert layout == {
        "llama8b.yaml": (1, 1),
        "llama70b.yaml": (4, 1),
        "llama405b.yaml": (8, 2),
        "llama405b-fp8.yaml": (8, 1),
        "llama8b-fp8.yaml": (1, 1),
        "llama70b-fp8.yaml": (2, 1),
        "llama405b-fp8-4gpu.yaml": (4, 1),
    }
    # vLLM quantizes the 8B and 70B bf16 checkpoints as it loads them; the 405B files run Meta's FP8 checkpoint,
    # which declares its method (fbgemm_fp8) itself and needs vLLM's consent to a deprecated method
    assert all(m[n].engine_kwargs["quantization"] == "fp8" for n in GPU_CONFIGS if "fp8" in n and "405b" not in n)
    for name in ("llama405b-fp8.yaml", "llama405b-fp8-4gpu.yaml"):
        assert "quantization" not in m[name].engine_kwargs and m[name].model_preset == "llama-3.1-405b-fp8"
        assert m[name].engine_kwargs["allow_deprecated_quantization"] is True
    assert [n for n in GPU_CONFIGS if m[n].engine_kwargs.get("kv_cache_dtype") == "fp8"] == [
        "llama8b-fp8.yaml",
        "llama70b-fp8.yaml",
    ]


def test_fp8_halves_what_validate_counts():
    out = {
        n: validate_file(CONFIGS / n, Hardware("h100-80gb", 8, 1), env={}).lines[0]
        for n in ("llama70b.yaml", "llama70b-fp8.yaml")
    }
    assert "TP 4 × PP 1, bf16 weights 32.9 GiB + bf16 KV 10.0 GiB" in out["llama70b.yaml"]  # 131.6 and 40 GiB in all
    assert "TP 2 × PP 1, fp8 weights 33.8 GiB + fp8 KV 10.0 GiB" in out["llama70b-fp8.yaml"]  # 67.6 and 20 GiB


def test_405b_fp8_on_two_a100_40gb_nodes_is_told_the_seeds_layout_only():
    """The seeds ran 405B FP8 at TP 8 × PP 2 on 16 A100-40GB. Advice names only changes that fit: not a context of 0
    tokens (the weights alone do not fit TP 8), not the fp8 quantization the config has."""
    a100 = Hardware("a100-40gb", 8, 2)
    report = validate_file(CONFIGS / "llama405b-fp8.yaml", a100, env={})
    (problem,) = report.problems
    assert problem.endswith("Fix: use tensor_parallel_size 8 × pipeline_parallel_size 2 (`summit plan`)"), problem
    assert validate_doc(with_model(load("llama405b-fp8.yaml"), pipeline_parallel_size=2), a100, env={}).ok
    (problem,) = validate_file(CONFIGS / "llama405b-fp8.yaml", Hardware("a100-40gb", 8, 1), env={}).problems
    assert "No change to this config fits 1 node × 8 a100-40gb" in problem and "pipeline" not in problem


def test_each_fix_named_fits_on_its_own(tmp_path):
    """An FP8 70B checkpoint (its config.json declares fp8: no 16-bit weights at load time) at TP 2 with 60 % of an
    H100 and a bf16 KV cache: short; each of the three fixes named fits."""
    from app.clusters.tiny_model import make_model_config

    engine = {
        "dtype": "bfloat16",
        "max_model_len": 131072,
        "max_num_seqs": 256,
        "gpu_memory_utilization": 0.6,
    }
    fp8_checkpoint = str(make_model_config("llama-3.1-70b", tmp_path / "70b-fp8", fp8="fp8"))
    doc = with_model(load("llama70b-fp8.yaml"), engine_kwargs=engine, source=fp8_checkpoint)
    h100 = Hardware("h100-80gb", 8, 1)
    (problem,) = validate_doc(doc, h100, env={}).problems
    assert problem.endswith(
        "Fix: use tensor_parallel_size 4 × pipeline_parallel_size 1 (`summit plan`), lower "
        "engine_kwargs.max_model_len to 77,138 or less, or store the KV cache in fp8 "
        "(engine_kwargs.kv_cache_dtype: fp8)"
    ), problem  # not the fp8 quantization it has
    assert validate_doc(with_model(doc, tensor_parallel_size=4), h100, env={}).ok
    assert validate_doc(with_model(doc, engine_kwargs={**engine, "max_model_len": 77138}), h100, env={}).ok
    assert not validate_doc(with_model(doc, engine_kwargs={**engine, "max_model_len": 77138 + 512}), h100, env={}).ok
    assert validate_doc(with_model(doc, engine_kwargs={**engine, "kv_cache_dtype": "fp8"}), h100, env={}).ok


def test_a_16_bit_checkpoint_quantized_as_it_loads_must_fit_its_16_bit_weights():
    """`quantization: fp8` on the bf16 70B at TP 2 with 60 % of an H100: the FP8 weights would fit, but vLLM allocates
    the bf16 ones first (70.55 B parameters x 2 B / 2 GPUs = 65.7 GiB a GPU): refused, naming the way out."""
    engine = {"dtype": "bfloat16", "quantization": "fp8", "max_model_len": 8192, "gpu_memory_utilization": 0.6}
    doc = with_model(load("llama70b-fp8.yaml"), engine_kwargs=engine)
    (problem,) = validate_doc(doc, Hardware("h100-80gb", 8, 1), env={}).problems
    assert "after allocating its 16-bit weights: 65.7 GiB per GPU at TP 2" in problem, problem
    assert validate_doc(with_model(doc, tensor_parallel_size=4), Hardware("h100-80gb", 8, 1), env={}).ok


def test_405b_bf16_on_one_node_is_short_of_gpus():
    report = validate_file(CONFIGS / "llama405b.yaml", Hardware("h100-80gb", 8, 1), env={})
    assert report.problems == [
        "the models need 16 GPUs (llama-3.1-405b 16) but 1 node × 8 h100-80gb has 8: short by 8 GPUs"
    ]


def test_405b_bf16_tp8_alone_does_not_fit_h100():
    report = validate_doc(
        with_model(load("llama405b.yaml"), pipeline_parallel_size=1), Hardware("h100-80gb", 8, 1), env={}
    )
    assert any("'llama-3.1-405b'" in p and "GiB per GPU" in p for p in report.problems)


def test_replicas_are_packed_node_by_node():
    doc = with_model(load("llama70b.yaml"), deployment={"num_replicas": 3}, gpus_per_node=None)
    assert validate_doc(doc, Hardware("h100-80gb", 8, 2), env={}).ok
    report = validate_doc(doc, Hardware("h100-80gb", 6, 2), env={})  # 4 + 4 + 4 GPUs on two 6-GPU nodes
    assert any("one replica needs 4 GPUs on one node" in p for p in report.problems)


@pytest.mark.parametrize(
    "changes, nodes, fits",
    [
        ({}, [4], True),  # the shipped 70B file (gpus_per_node 8, TP 4) on one four-GPU node
        ({"tensor_parallel_size": 8}, [4, 4], False),  # TP 8 must share a node: no node has 8
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, [4, 4], False),  # planned for 8-GPU nodes
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "gpus_per_node": 4}, [4, 4], True),
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "gpus_per_node": 4}, [8], True),
        ({"tensor_parallel_size": 8, "pipeline_parallel_size": 2}, [4, 4, 4, 4], False),  # PACK: TP groups of 8
        ({"tensor_parallel_size": 8, "pipeline_parallel_size": 2}, [8, 8], True),
    ],
)
def test_validate_and_deploy_agree_on_what_fits_the_nodes(monkeypatch, changes, nodes, fits):
    """`gpus_per_node` says how Summit splits a replica over nodes, not what the cluster has: `summit validate
    --gpus-per-node N` and `serve deploy` (the builder's check of the live nodes) accept and refuse the same files on
    the same nodes, and a refusal names the key to set."""
    import sys

    from app.build import builder

    doc = with_model(load("llama70b.yaml"), **changes)
    report = validate_doc(doc, Hardware("h200-141gb", nodes[0], len(nodes)), env={})
    placement = [p for p in report.problems if "on one node" in p]
    assert report.ok if fits else placement, report.problems
    config = SummitConfig.model_validate({**doc["applications"][0]["args"], "placement_wait_s": 0})  # no waiting
    monkeypatch.setitem(sys.modules, "ray", _FakeRay([{"GPU": float(g), "CPU": 64.0} for g in nodes]))
    monkeypatch.setattr(builder, "check_sources", lambda models: None)
    if fits:
        builder.check_before_deploy(config)
    else:
        with pytest.raises(ValueError, match="on one node") as e:
            builder.check_before_deploy(config)
        # every part refused here is larger than any node: split it over nodes, or (a TP group) make it smaller
        tp = changes.get("tensor_parallel_size", 4)
        fix = f"gpus_per_node: {max(nodes)}`" if tp <= max(nodes) else f"lower tensor_parallel_size to {max(nodes)}"
        assert fix in str(e.value) and fix in placement[0], (str(e.value), placement)


def test_tp_across_nodes_is_refused_by_placement():
    doc = with_model(load("llama405b.yaml"), tensor_parallel_size=16, pipeline_parallel_size=1)
    report = validate_doc(doc, Hardware("h100-80gb", 8, 2), env={})
    assert any("tensor_parallel_size=16 is larger than gpus_per_node=8" in p for p in report.problems)
    assert validate_doc(with_model(doc, allow_cross_node_tp=True), Hardware("h100-80gb", 8, 2), env={}).ok


def test_config_json_under_source_wins_over_the_preset(tmp_path):
    from app.clusters.tiny_model import make_model_config

    make_model_config("llama-3.1-8b", tmp_path / "shape")  # the 8B shapes under a 70B preset name
    doc = with_model(load("llama70b.yaml"), tensor_parallel_size=1)
    assert not validate_doc(doc, Hardware("h100-80gb", 8, 1), env={}).ok
    assert validate_doc(doc, Hardware("h100-80gb", 8, 1), env={"LLAMA70B_PATH": str(tmp_path / "shape")}).ok


def test_missing_shape_names_the_fix():
    doc = with_model(load("llama8b.yaml"), model_preset=None)
    report = validate_doc(doc, Hardware("h100-80gb", 8, 1), env={})
    assert any("set `model_preset: llama-3.1-70b`" in p for p in report.problems)


def test_summit_validate_cli_exit_codes(capsys):
    assert main(["validate", str(CONFIGS / "llama405b-fp8.yaml"), "--gpu", "h100-80gb", "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-405b-fp8: TP 8 × PP 1, fp8 weights" in out and ": ok" in out
    assert (
        main(
            ["validate", str(CONFIGS / "llama405b.yaml"), "--gpu", "h100-80gb", "--gpus-per-node", "8", "--nodes", "1"]
        )
        == 1
    )
    assert "short by 8 GPUs" in capsys.readouterr().err


def test_summit_validate_cli_rejects_bad_args(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_model(load("llama8b.yaml"), tensor_parallel=2)))
    assert main(["validate", str(bad), "--gpu", "h100-80gb", "--nodes", "1"]) == 1
    assert "tensor_parallel" in capsys.readouterr().err


def test_engine_settings_from_the_environment_go_over_every_models(monkeypatch):
    """SUMMIT_ENGINE_KWARGS (a JSON object) is put over each model's engine_kwargs where the app is built, so that a
    shipped file runs with random weights (load_format: dummy) without an edited copy; bad values name the variable."""
    from app.build.engine_checks import load_config

    args = load("llama70b.yaml")["applications"][0]["args"]
    assert "load_format" not in load_config(args).models[0].engine_kwargs
    monkeypatch.setenv("SUMMIT_ENGINE_KWARGS", '{"load_format": "dummy", "max_model_len": 8192}')
    kwargs = load_config(args).models[0].engine_kwargs
    assert kwargs["load_format"] == "dummy" and kwargs["max_model_len"] == 8192 and kwargs["max_num_seqs"] == 256
    for bad in ("load_format=dummy", '["dummy"]'):
        monkeypatch.setenv("SUMMIT_ENGINE_KWARGS", bad)
        with pytest.raises(ValueError, match="SUMMIT_ENGINE_KWARGS"):
            load_config(args)


def test_metas_405b_fp8_on_four_gpus_fits_h200s_at_64k_context_not_h100s():
    """Meta's FP8 checkpoint (the preset: its config.json's quantization_config exactly) at TP 4: attention and the
    first and last layer stay bf16. By hand: attention (2 x 16384^2 + 2 x 16384 x 1024) x 2 B x 126 layers =
    143.75 GB; feed-forward 3 x 16384 x 53248 = 2.617 B parameters a layer, x 1 B x 124 + x 2 B x 2 = 335.01 GB;
    embeddings and lm_head 2 x 128256 x 16384 x 2 B = 8.41 GB; norms 8.3 MB: 487.17 GB = 453.7 GiB, 113.4 GiB a GPU.
    It fits four H200s at the YAML's 65,536-token context, not at 131,072 (the shortfall named), and never four H100s.
    Sized with every linear layer in FP8 (vLLM's fp8 method), the same shapes would claim 95.5 GiB a GPU."""
    doc = load("llama405b-fp8-4gpu.yaml")
    report = validate_doc(doc, Hardware("h200-141gb", 4, 1), env={})
    assert report.ok and "fp8 weights 113.4 GiB" in report.lines[0], report.lines
    (problem,) = validate_doc(with_engine(doc, max_model_len=131072), Hardware("h200-141gb", 4, 1), env={}).problems
    assert "short by" in problem and "max_model_len to 89,434" in problem, problem
    (problem,) = validate_doc(doc, Hardware("h100-80gb", 4, 1), env={}).problems
    assert "short by" in problem and "GiB per GPU" in problem
    all_fp8 = validate_doc(with_model(doc, model_preset="llama-3.1-405b"), Hardware("h200-141gb", 4, 1), env={})
    assert "bf16 weights" in all_fp8.lines[0]  # the bf16 preset: no quantization_config to size by
