"""`summit validate`'s checks of a checkpoint on the submitting machine (app/plan/checkpoint.py), against the installed
vLLM's own registries (no engine starts): each case is one a replica would otherwise fail on minutes into its start
(tests/cpu/test_start_failures.py shows the engine's own refusal of the same)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from app.clusters.tiny_model import make_model_config, make_tiny_model
from app.plan.validate import Hardware, validate_doc

REPO = Path(__file__).resolve().parents[2]
H200 = Hardware("h200-141gb", 8, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def serve_doc(model: dict, env_vars: dict | None = None) -> dict:
    """The shipped tiny YAML with `model` as its one model."""
    doc = yaml.safe_load((REPO / "serve_configs/tiny-cpu.yaml").read_text())
    doc["applications"][0]["args"]["models"] = [model]
    if env_vars is not None:
        doc["applications"][0]["runtime_env"]["env_vars"] = env_vars
    return doc


def changed_copy(tiny: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((copy / "config.json").read_text())
    change(cfg)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def cpu_model(source: Path, **engine) -> dict:
    return {"name": "m", "source": str(source), "accelerator": "cpu", "engine_kwargs": {"dtype": "bfloat16", **engine}}


def test_an_architecture_vllm_does_not_serve_is_refused(tiny, tmp_path):
    source = changed_copy(tiny, tmp_path, lambda c: c.update(architectures=["NoSuchLM"]))
    problems = validate_doc(serve_doc(cpu_model(source)), H200, env={}).problems
    assert len(problems) == 1 and "['NoSuchLM'] are not in the installed vLLM's model registry" in problems[0], problems
    assert validate_doc(serve_doc(cpu_model(tiny)), H200, env={}).ok  # LlamaForCausalLM: in the registry


def test_a_quantization_vllm_refuses_is_refused_and_a_deprecated_one_needs_consent(tmp_path):
    """Meta's FP8 405B (its exact quantization_config, 2 layers at full width): fbgemm_fp8 is deprecated in the
    installed vLLM, refused without engine_kwargs.allow_deprecated_quantization; a method vLLM does not have is
    refused whatever the consent."""
    source = make_model_config("llama-3.1-405b-fp8", tmp_path / "meta-fp8", layers=2)
    model = {"name": "m", "source": str(source), "accelerator": "gpu", "tensor_parallel_size": 8}
    model["engine_kwargs"] = {"max_model_len": 8192}
    (problem,) = validate_doc(serve_doc(model), H200, env={}).problems
    assert "'fbgemm_fp8' is deprecated" in problem and "allow_deprecated_quantization" in problem, problem
    model["engine_kwargs"]["allow_deprecated_quantization"] = True
    assert validate_doc(serve_doc(model), H200, env={}).ok
    cfg = json.loads((source / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "no_such_method"
    (source / "config.json").write_text(json.dumps(cfg))
    (problem,) = validate_doc(serve_doc(model), H200, env={}).problems
    assert "'no_such_method' is not a method of the installed vLLM" in problem, problem


def test_heads_that_do_not_divide_by_tp_and_a_context_past_the_models_are_refused(tmp_path):
    source = make_model_config("llama-3.1-8b", tmp_path / "8b")  # 32 heads, 8 KV heads, 131,072 positions
    model = {"name": "m", "source": str(source), "accelerator": "gpu", "tensor_parallel_size": 3}
    model["engine_kwargs"] = {"max_model_len": 200_000}
    problems = validate_doc(serve_doc(model), H200, env={}).problems
    assert any("32 attention heads do not divide by tensor_parallel_size 3" in p for p in problems), problems
    assert any("KV heads and tensor_parallel_size 3" in p for p in problems), problems
    assert any("max_model_len 200,000 is longer than the model's context (131,072" in p for p in problems), problems


def test_a_cpu_kv_cache_too_small_for_one_sequence_is_refused_with_vllms_own_figure(tiny):
    """1 MiB of KV cache for the tiny model (512 B a token, 128-token blocks, one block vLLM's own): room for 1,920
    tokens, the figure vLLM's engine itself gave for this setting ("the estimated maximum model length is 1920",
    tests/cpu/test_start_failures.py's kv-cache case)."""
    doc = serve_doc(cpu_model(tiny, max_model_len=2048, kv_cache_memory_bytes=1 << 20), env_vars={})
    (problem,) = validate_doc(doc, H200, env={}).problems
    assert "leaves room for 1,920 tokens" in problem and "engine_kwargs.kv_cache_memory_bytes" in problem, problem
    # VLLM_CPU_KVCACHE_SPACE (GiB), which vLLM's CPU engine takes over kv_cache_memory_bytes: it fits
    assert validate_doc(serve_doc(cpu_model(tiny, max_model_len=2048, kv_cache_memory_bytes=1 << 20)), H200, {}).ok


def test_a_weights_directory_missing_here_is_a_note_and_an_unreadable_one_a_problem(tiny, tmp_path):
    """A path this machine does not have may be one only the compute nodes mount: said, not refused. A directory this
    user cannot read is refused (checked as an unprivileged user: root reads anything)."""
    report = validate_doc(serve_doc(cpu_model(tmp_path / "elsewhere")), H200, env={})
    assert report.ok and "is not on this machine" in report.notes[0], report
    outer = Path(tempfile.mkdtemp(prefix="summit-unreadable-"))  # /tmp/pytest-of-root is root's alone
    os.chmod(outer, 0o755)
    private = outer / "private"
    private.mkdir(mode=0o700)
    for f in tiny.iterdir():
        (private / f.name).write_bytes(f.read_bytes())
    os.chmod(private, 0o700)
    doc = serve_doc(cpu_model(private))
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # an unprivileged user's view of the same check (the parent's interpreter, forked)
        try:
            os.setgid(65534)
            os.setuid(65534)
            said = json.dumps(validate_doc(doc, H200, env={}).problems)
        except BaseException as e:  # noqa: BLE001 — said to the parent, which fails on it
            said = json.dumps([f"the check raised: {e!r}"])
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(child, 0)
    shutil.rmtree(outer)
    (problem,) = json.loads(said)
    assert "is not readable by this user" in problem, problem
