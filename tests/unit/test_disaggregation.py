"""Prefill/decode disaggregation without engines: the config (validated, each side derived), the deployments it
becomes, `summit validate` sizing both pools, and the decode replica's front driving a fake prefill pool
(`FakePrefill`, standing in for the prefill deployment's handle) around a fake engine app. The real engines and
connector: tests/cpu/test_disaggregation.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError

from app.build.disaggregation import disaggregation_problem, pd_side
from app.build.engine_checks import load_config
from app.build.options import engine_pools, llm_deployment_options, prefill_deployment_options, serving_models
from app.config import SummitConfig
from app.plan.validate import Hardware, validate_doc
from deployments.engine import engine_args
from deployments.http.errors import OpenAIError
from deployments.http.protocol import ResponseStart
from deployments.pipeline.prefill import Disaggregated
from tests.unit.test_front import make_front


def pd_model(**pd) -> dict:
    return {
        "name": "m",
        "source": "/models/m",
        "accelerator": "cpu",
        "disaggregation": {"connector": "shared_storage", **pd},
    }


def error_text(model: dict) -> str:
    with pytest.raises(ValidationError) as e:
        load_config({"models": [model]})
    return str(e.value)


def test_each_side_is_the_model_with_its_own_settings_and_kv_transfer_config():
    m = load_config(
        {
            "models": [
                pd_model(
                    prefill={"deployment": {"num_replicas": 2}, "engine_kwargs": {"max_num_seqs": 4}},
                    connector_config={"shared_storage_path": "/kv"},
                    fallback="error",
                )
            ]
        }
    ).models[0]
    prefill, decode = pd_side(m, "prefill"), pd_side(m, "decode")
    assert prefill.deployment.num_replicas == 2 and decode.deployment.num_replicas == 1
    assert engine_args(prefill)["max_num_seqs"] == 4 and "max_num_seqs" not in decode.engine_kwargs
    kv = {side: engine_args(cfg)["kv_transfer_config"] for side, cfg in (("p", prefill), ("d", decode))}
    assert kv["p"]["kv_connector"] == kv["d"]["kv_connector"] == "ExampleConnector"
    assert (kv["p"]["kv_role"], kv["d"]["kv_role"]) == ("kv_producer", "kv_consumer")
    assert (
        kv["d"]["kv_connector_extra_config"] == {"shared_storage_path": "/kv"} and kv["d"]["kv_buffer_device"] == "cpu"
    )
    assert kv["d"].get("kv_load_failure_policy", "fail") == "fail"  # fallback: error
    assert decode.disaggregation_fallback == "error" and prefill.disaggregation is None


def test_what_pd_cannot_do_is_refused_naming_the_key():
    assert "'nope' is not a KV connector" in error_text(pd_model(connector="nope"))
    nixl = load_config({"models": [pd_model(connector="nixl")]}).models[0]  # valid YAML: `summit validate`
    assert "nixl needs NIXL" in disaggregation_problem(nixl)  # ... but where the app is built without NIXL: refused
    assert "disaggregation.prefill with tensor_parallel_size" in error_text(
        pd_model(prefill={"tensor_parallel_size": 2})
    )
    assert "needs GPUs" in error_text(pd_model(kv_buffer_device="cuda"))
    assert "replicas" in error_text(pd_model(decode={"replicas": 2}))
    assert "engine_kwargs.max_num_seq" in error_text(pd_model(decode={"engine_kwargs": {"max_num_seq": 2}}))
    text = error_text({**pd_model(), "engine_kwargs": {"kv_transfer_config": {}}})
    assert "engine_kwargs.kv_transfer_config" in text and "disaggregation" in text


def test_the_decode_side_serves_and_the_prefill_side_is_a_deployment_of_its_own():
    config = SummitConfig.model_validate(
        {"models": [pd_model(), {"name": "a", "source": "/models/a", "accelerator": "cpu"}]}
    )
    serving = serving_models(config.models)
    assert [m.name for m in serving] == ["m", "a"]
    assert serving[0].engine_kwargs["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert prefill_deployment_options(config.models[0])["name"] == "LLMServer:m:prefill"
    assert [label for label, _ in engine_pools(config.models[0])] == ["m prefill", "m decode"]


def test_validate_sizes_both_pools():
    doc = {
        "applications": [
            {
                "import_path": "app.build:build_app",
                "args": {
                    "models": [
                        {
                            "name": "llama",
                            "source": "/nowhere",
                            "model_preset": "llama-3.1-8b",
                            "engine_kwargs": {"max_model_len": 8192},
                            "disaggregation": {
                                "connector": "shared_storage",
                                "kv_buffer_device": "cpu",
                                "prefill": {"deployment": {"num_replicas": 2}},
                            },
                        }
                    ]
                },
            }
        ]
    }
    report = validate_doc(doc, Hardware("h100-80gb", 8, 1), env={})
    assert report.ok, report.problems
    text = "\n".join(report.lines)
    assert "llama prefill: TP 1" in text and "llama decode: TP 1" in text
    assert "GPUs: 3 of 8" in text  # 2 prefill replicas + 1 decode replica


class FakeEngineApp:
    """A fake engine app: records each body it runs and answers {"ran": body}."""

    def __init__(self):
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send):
        body = json.loads((await receive())["body"])
        self.bodies.append(body)
        data = json.dumps({"ran": body}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data, "more_body": False})


class FakePrefill:
    """Stands in for the prefill deployment's handle: a response stream answering `status` and `body`, or raising
    ModelUnavailable (`down`), or never answering (`hang`); records requests and cancels."""

    def __init__(self, status=200, body=None, down=False, hang=False):
        self.status, self.down, self.hang = status, down, hang
        self.body = body if body is not None else {"choices": [{"text": "x"}], "kv_transfer_params": {"remote": 7}}
        self.requests, self.cancelled = [], False

    def __call__(self, request):
        self.requests.append(json.loads(request.body))
        fake = self

        class Stream:
            def __init__(self):
                self.items = None

            def __aiter__(self):
                return self

            async def __anext__(self):
                if fake.down:
                    raise OpenAIError.unavailable("the prefill replica is gone")
                if fake.hang:
                    await asyncio.sleep(3600)
                if self.items is None:
                    self.items = [ResponseStart(fake.status, []), json.dumps(fake.body).encode()]
                if not self.items:
                    raise StopAsyncIteration
                return self.items.pop(0)

            def cancel(self):
                fake.cancelled = True

        return Stream()


def front(prefill: FakePrefill, fallback="aggregated"):
    engine = FakeEngineApp()
    app = make_front(
        engine, "m", ["m"], None, lambda: False, "replica-1", disaggregated=Disaggregated(prefill, fallback)
    )
    return app, engine


async def call(app, body):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        return await client.post("/v1/completions", json=body)


BODY = {"model": "m", "prompt": "p" * 300, "max_tokens": 50, "stream": True, "n": 2, "logprobs": 2}


def test_the_prompt_is_prefilled_then_decoded_with_the_prefills_kv_params():
    prefill = FakePrefill()
    app, engine = front(prefill)
    r = asyncio.run(call(app, BODY))
    assert r.status_code == 200
    (sent,) = prefill.requests
    assert (
        sent["max_tokens"] == 1 and sent["stream"] is False and sent["kv_transfer_params"]["do_remote_decode"] is True
    )
    assert "n" not in sent and "logprobs" not in sent and sent["prompt"] == BODY["prompt"]
    (ran,) = engine.bodies
    assert ran == {**BODY, "kv_transfer_params": {"remote": 7}}  # the client's request, plus where its KV is


@pytest.mark.parametrize("prefill", [FakePrefill(down=True), FakePrefill(status=503)])
def test_a_failed_prefill_falls_back_to_the_decode_engine_or_503(prefill):
    app, engine = front(prefill, "aggregated")
    assert asyncio.run(call(app, BODY)).status_code == 200 and engine.bodies == [BODY]  # computes the prompt itself
    app, engine = front(prefill, "error")
    r = asyncio.run(call(app, BODY))
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert engine.bodies == []


def test_the_prefills_own_4xx_is_the_answer_and_decode_only_limits_are_named():
    app, engine = front(FakePrefill(status=400, body={"detail": "max_tokens must be at least 1"}))
    r = asyncio.run(call(app, BODY))
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"] and engine.bodies == []
    app, engine = front(prefill := FakePrefill())
    for extra, named in (({"echo": True}, "echo"), ({"prompt_logprobs": 0}, "prompt_logprobs")):
        r = asyncio.run(call(app, {**BODY, **extra}))
        assert r.status_code == 400 and named in r.json()["error"]["message"]
    assert prefill.requests == [] and engine.bodies == []


def test_a_client_leaving_during_the_prefill_cancels_it():
    prefill = FakePrefill(hang=True)
    app, engine = front(prefill)

    async def scenario():
        sent = []

        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False}
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        async def send(message):
            raise AssertionError(f"nothing should be sent to a client that left: {message}")

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        await asyncio.wait_for(app(scope, receive, send), 5)

    asyncio.run(scenario())
    assert prefill.cancelled and engine.bodies == []


def test_building_the_app_where_the_connector_cannot_run_fails_naming_it():
    from app.build.builder import build_app

    with pytest.raises(ValueError, match=r"model 'm': disaggregation.connector: nixl needs NIXL"):
        build_app({"models": [pd_model(connector="nixl")]})


def test_each_nixl_engine_gets_its_own_side_channel_port_on_the_nodes_address():
    from types import SimpleNamespace

    from deployments.engine.app import _own_kv_side_channel

    nixl = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="NixlConnector"))
    first, second = {}, {}
    _own_kv_side_channel(nixl, first)
    _own_kv_side_channel(nixl, second)
    assert first["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert int(first["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0 and first["VLLM_NIXL_SIDE_CHANNEL_PORT"] != "5600"
    given = {"VLLM_NIXL_SIDE_CHANNEL_PORT": "7000", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2"}
    _own_kv_side_channel(nixl, given)
    assert given == {"VLLM_NIXL_SIDE_CHANNEL_PORT": "7000", "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.2"}
    untouched = {}
    _own_kv_side_channel(
        SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="ExampleConnector")), untouched
    )
    _own_kv_side_channel(SimpleNamespace(kv_transfer_config=None), untouched)
    assert untouched == {}


def test_nixl_engines_read_remote_kv_over_cuda_ipc_unless_the_environment_says_otherwise():
    """UCX emulates a GET between GPUs of one node over TCP unless it detects NVLink (one H200: 9.1 s for 4 GB,
    14 ms with the GET on cuda_ipc). Fails if a NIXL engine's environment does not turn it on, if a user's own value
    is overwritten, or if another connector's engine gets it."""
    from types import SimpleNamespace

    from deployments.engine.app import _nixl_reads_over_cuda_ipc

    nixl = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="NixlConnector"))
    env: dict = {}
    _nixl_reads_over_cuda_ipc(nixl, env)
    assert env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    given = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    _nixl_reads_over_cuda_ipc(nixl, given)
    assert given == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    untouched: dict = {}
    _nixl_reads_over_cuda_ipc(
        SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="ExampleConnector")), untouched
    )
    _nixl_reads_over_cuda_ipc(SimpleNamespace(kv_transfer_config=None), untouched)
    assert untouched == {}


# kv_migration: every replica of the model runs the connector both ways (a moving stream's KV goes along)


def kv_model(**kv) -> dict:
    return {
        "name": "m",
        "source": "/models/m",
        "accelerator": "cpu",
        "kv_migration": {"connector": "shared_storage", **kv},
    }


def test_a_kv_migrating_model_runs_its_connector_both_ways_on_every_replica():
    config = load_config({"models": [kv_model(min_tokens=64)]})
    (served,) = serving_models(config.models)
    kv = engine_args(served)["kv_transfer_config"]
    assert kv["kv_connector"] == "ExampleConnector" and kv["kv_role"] == "kv_both"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/tmp/summit-kv/m-migration"
    assert kv["kv_buffer_device"] == "cpu"
    # the example connector stores a prompt's KV from its first step: whole prompts (FACTS)
    assert engine_args(served)["enable_chunked_prefill"] is False
    assert engine_pools(config.models[0]) == [("m", served)]
    # Summit's router even under least_load: a moved stream's continuation skips the replica it left
    assert "ModelPolicyRouter" in llm_deployment_options(served)["request_router_config"]["request_router_class"]
    plain = load_config({"models": [{k: v for k, v in kv_model().items() if k != "kv_migration"}]})
    assert "kv_transfer_config" not in engine_args(serving_models(plain.models)[0])


def test_what_kv_migration_cannot_do_is_refused_naming_the_key():
    assert "`kv_migration` and `disaggregation` together" in error_text(
        {**kv_model(), "disaggregation": {"connector": "shared_storage"}}
    )
    assert "stream_migration: off moves none" in error_text({**kv_model(), "stream_migration": "off"})
    assert "kv_migration.kv_buffer_device 'cuda' needs GPUs" in error_text(kv_model(kv_buffer_device="cuda"))
    assert "kv_migration.min_tokens" in error_text(kv_model(min_tokens=0)).replace("\n", ".")


def test_the_example_connector_hands_off_all_but_the_last_token():
    from deployments.engine import hand_off_tokens

    # it stores n tokens under their first (n-1)//block*block and looks a prompt of n up under (n-2)//block*block
    assert hand_off_tokens("shared_storage", [1, 2, 3]) == [1, 2]
    assert hand_off_tokens("nixl", [1, 2, 3]) == [1, 2, 3]
