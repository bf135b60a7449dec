"""Every shipped Serve YAML validates, and `summit validate` accepts each on its hardware and refuses what cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.cli import main
from app.config import SummitConfig
from app.validate import Hardware, validate_doc, validate_file

CONFIGS = Path(__file__).parents[2] / "serve_configs"
GPU_CONFIGS = {  # file → the hardware it is written for: (gpu, gpus per node, nodes)
    "llama8b.yaml": ("h100-80gb", 8, 1),
    "llama70b.yaml": ("h100-80gb", 8, 1),
    "llama405b.yaml": ("h100-80gb", 8, 2),
    "llama405b-fp8.yaml": ("h100-80gb", 8, 1),
}


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def with_model(doc: dict, **changes) -> dict:
    model = {**doc["applications"][0]["args"]["models"][0], **changes}
    app = {**doc["applications"][0], "args": {**doc["applications"][0]["args"], "models": [model]}}
    return {**doc, "applications": [app]}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_serve_config_validates(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["http_options"]["host"] == "127.0.0.1"
    for app in doc["applications"]:
        assert app["import_path"] == "app.builder:build_app"
        SummitConfig.model_validate(app["args"])


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_use_token_auth_an_env_var_path_and_a_preset(name):
    doc = load(name)
    app = doc["applications"][0]
    assert app["runtime_env"]["env_vars"]["RAY_AUTH_MODE"] == "token"
    model = app["args"]["models"][0]
    assert model["source"].startswith("${LLAMA") and ":-/models/" in model["source"]
    assert model["model_preset"].startswith("llama-3.1-") and model["accelerator"] == "gpu"
    assert "load_format: dummy" in (CONFIGS / name).read_text()  # the switch to dummy weights is documented


@pytest.mark.parametrize(("name", "hardware"), sorted(GPU_CONFIGS.items()))
def test_summit_validate_accepts_each_config_on_its_hardware(name, hardware):
    report = validate_file(CONFIGS / name, Hardware(*hardware), env={})
    assert report.ok, report.problems


def test_intended_layouts():
    m = {n: SummitConfig.model_validate(load(n)["applications"][0]["args"]).models[0] for n in GPU_CONFIGS}
    layout = {n: (x.tensor_parallel_size, x.pipeline_parallel_size) for n, x in m.items()}
    assert layout == {"llama8b.yaml": (1, 1), "llama70b.yaml": (4, 1), "llama405b.yaml": (8, 2), "llama405b-fp8.yaml": (8, 1)}
    assert m["llama405b-fp8.yaml"].engine_kwargs["quantization"] == "fp8"


def test_70b_tp2_fits_h200_but_not_h100():
    doc = with_model(load("llama70b.yaml"), tensor_parallel_size=2)
    assert validate_doc(doc, Hardware("h200-141gb", 8, 1), env={}).ok
    report = validate_doc(doc, Hardware("h100-80gb", 8, 1), env={})
    assert not report.ok
    text = " ".join(report.problems)
    assert "'llama-3.1-70b'" in text and "short by 16.2 GiB per GPU" in text
    assert "tensor_parallel_size 4" in text and "engine_kwargs.max_model_len" in text


def test_405b_bf16_on_one_node_is_short_of_gpus():
    report = validate_file(CONFIGS / "llama405b.yaml", Hardware("h100-80gb", 8, 1), env={})
    assert report.problems == ["the models need 16 GPUs (llama-3.1-405b 16) but 1 node × 8 h100-80gb has 8: short by 8 GPUs"]


def test_405b_bf16_tp8_alone_does_not_fit_h100():
    report = validate_doc(with_model(load("llama405b.yaml"), pipeline_parallel_size=1), Hardware("h100-80gb", 8, 1), env={})
    assert any("'llama-3.1-405b'" in p and "GiB per GPU" in p for p in report.problems)


def test_replicas_are_packed_node_by_node():
    doc = with_model(load("llama70b.yaml"), deployment={"num_replicas": 3}, gpus_per_node=None)
    assert validate_doc(doc, Hardware("h100-80gb", 8, 2), env={}).ok
    report = validate_doc(doc, Hardware("h100-80gb", 6, 2), env={})  # 4 + 4 + 4 GPUs on two 6-GPU nodes
    assert any("group of 4 GPUs on one node" in p for p in report.problems)


def test_tp_across_nodes_is_refused_by_placement():
    doc = with_model(load("llama405b.yaml"), tensor_parallel_size=16, pipeline_parallel_size=1)
    report = validate_doc(doc, Hardware("h100-80gb", 8, 2), env={})
    assert any("tensor_parallel_size=16 is larger than gpus_per_node=8" in p for p in report.problems)
    assert validate_doc(with_model(doc, allow_cross_node_tp=True), Hardware("h100-80gb", 8, 2), env={}).ok


def test_config_json_under_source_wins_over_the_preset(tmp_path):
    from app.tiny_model import make_model_config

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
    assert main(["validate", str(CONFIGS / "llama405b.yaml"), "--gpu", "h100-80gb", "--gpus-per-node", "8", "--nodes", "1"]) == 1
    assert "short by 8 GPUs" in capsys.readouterr().err


def test_summit_validate_cli_rejects_bad_args(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_model(load("llama8b.yaml"), tensor_parallel=2)))
    assert main(["validate", str(bad), "--gpu", "h100-80gb", "--nodes", "1"]) == 1
    assert "tensor_parallel" in capsys.readouterr().err
