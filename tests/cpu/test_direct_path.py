"""Two models of one application on the direct path (Serve's HAProxy -> the engine replica's own HTTP port; the route
picker chooses each request's replica by the body's model), on the real engine.

One base URL serves both: each answer comes from a replica of the model the body names; nothing sits between
HAProxy and the engine replicas (no OpenAIIngress; HAProxy's config pins requests to the engine replicas' ports);
a body longer than HAProxy's routing buffer (its model cut off) is still answered by its model; a client that
leaves a stream aborts the engine request; the app redeployed from a YAML whose models differ in shape falls back to
the two-hop path, where a dead engine is answered 503 + Retry-After and replaced, and a disaggregated model with
`fallback: error` answers 503 while its prefill engine is dead.
"""

from __future__ import annotations

import io
import json
import re

import httpx
import openai
import pytest

from tests.cpu.engine_apps import APP, app_config, deployed, deployment_details, tiny_model, wait_for
from tests.engine_checks import Throttle, engine_core_processes, kill_engine_and_wait_for_answers, model_engine_cores
from tests.ray_metrics import scrape, settled, total
from tests.replica_probe import probe

MODELS = ["tiny-a", "tiny-b"]
POOL = "LLMServer:tiny-a+tiny-b"
# long enough that a stream outlasts the probe of the engine (a subprocess driver: seconds on a loaded box)
MAX_LEN = 8192


@pytest.fixture(scope="module")
def two_models(tiny_model_dir):
    with deployed(
        [tiny_model(name, engine_kwargs={"max_model_len": MAX_LEN}) for name in MODELS], tiny_model_dir, haproxy=True
    ) as cluster:
        yield cluster


def replicas_by_model(cluster) -> dict[str, str]:
    """{replica_id: model}, as each engine replica reports it (LLMServer.stats through a Serve handle)."""
    answers = probe(cluster.address, "each", APP, POOL, "stats", "--replicas", "2")
    return {rid: s["model"] for rid, s in answers.items()}


def test_the_engine_replicas_are_the_ingress(two_models):
    deployments = two_models.dashboard_get("/api/serve/applications/")["applications"][APP]["deployments"]
    assert set(deployments) == {POOL, "RoutePicker"}  # no OpenAIIngress: no Python hop in the request path
    replicas = deployment_details(two_models, POOL)["replicas"]
    assert len(replicas) == 2

    def pinned_servers() -> list[str]:
        """HAProxy's servers that the route picker's answer pins a request to."""
        config = next((two_models.temp_dir / "h").rglob("haproxy.cfg")).read_text()
        assert "lua.route_via_ingress_request_router" in config
        return re.findall(r"use-server (\S+) if \{ var\(txn.ingress_request_router_target\)", config)

    assert wait_for(lambda: len(pinned_servers()) == 2, 30), pinned_servers()
    assert all(any(r["replica_id"] in s for r in replicas) for s in pinned_servers())


def test_one_base_url_serves_both_models_from_their_own_replicas(two_models):
    owner = replicas_by_model(two_models)
    assert sorted(owner.values()) == MODELS
    client = openai.OpenAI(base_url=two_models.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert sorted(m.id for m in client.models.list().data) == MODELS
    for name in MODELS * 3:
        raw = client.completions.with_raw_response.create(
            model=name, prompt="hello", max_tokens=4, extra_headers={"x-request-id": f"req-{name}"}
        )
        assert raw.parse().model == name and raw.headers["x-request-id"] == f"req-{name}"
        assert owner[raw.headers["x-summit-replica"]] == name
        with client.chat.completions.with_streaming_response.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        ) as stream:
            chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
            assert owner[stream.headers["x-summit-replica"]] == name
        assert chunks and {c["model"] for c in chunks} == {name}
    r = httpx.post(two_models.base_url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and "tiny-a" in r.json()["error"]["message"]


def test_a_body_cut_at_the_routing_buffer_is_answered_by_its_model(two_models):
    owner = replicas_by_model(two_models)
    # messages first, model last (as the openai client sends them): past 256 KiB HAProxy gives the picker no model
    long_text = "hello " * 50_000  # 300 KB of JSON, ~50k tokens: vLLM answers its own 400 (context MAX_LEN)
    for name in MODELS:
        body = json.dumps({"messages": [{"role": "user", "content": long_text}], "max_tokens": 1, "model": name})
        r = httpx.post(
            two_models.base_url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400 and str(MAX_LEN) in r.json()["error"]["message"], r.text[:300]
        assert owner[r.headers["x-summit-replica"]] == name  # vLLM's answer, from an engine of the right model
        short = httpx.post(
            two_models.base_url + "/v1/completions",
            json={"prompt": "x " * 500, "max_tokens": 1, "model": name},
            timeout=60,
        )
        assert short.status_code == 200 and owner[short.headers["x-summit-replica"]] == name


def test_client_leaving_a_stream_aborts_the_engine_request(two_models):
    """Read from the engines' own counters, not the client: how many tokens they made for a stream left after 3."""

    def engines(method: str) -> dict:
        return probe(two_models.address, "each", APP, POOL, method, "--replicas", "2")

    def generated() -> float:  # vLLM's counter, as Ray's metrics endpoint exports it (settled: up to date)
        return settled(lambda: total(scrape(two_models), "ray_vllm_generation_tokens_total"))

    assert wait_for(lambda: sum(s["num_unfinished_requests"] for s in engines("stats").values()) == 0, 60)
    before = generated()
    # the engines crawl (paused but 2 ms of every 250) from before the stream starts until the replica has seen the
    # client leave: on a loaded box the tiny model made all its tokens while the client read its first three lines
    with Throttle(model_engine_cores(two_models, "+".join(MODELS))):
        with httpx.stream(
            "POST",
            two_models.base_url + "/v1/completions",
            timeout=60,
            json={"model": "tiny-b", "prompt": "a", "max_tokens": MAX_LEN - 100, "ignore_eos": True, "stream": True},
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept referenced: a dropped iterator closes the response (the client leaves)
            for _ in range(3):
                next(lines)
        assert wait_for(lambda: sum(s["num_unfinished_requests"] for s in engines("stats").values()) == 0, 120)
    made = generated() - before
    # aborted: the engine stopped long before the tokens it would have made for a client that stayed
    assert 1 <= made < 0.5 * (MAX_LEN - 100), f"the engines made {made} tokens for a stream left after 3 lines"


def test_models_of_different_shapes_fall_back_to_two_hops(two_models, tmp_path):
    """The module's cluster, its app redeployed (last: the direct-path tests are done) with models of two shapes and
    the Batch API: the app moves to the two-hop path, as a user's `serve deploy` of the changed YAML moves it.
    `tiny-c` is disaggregated with `fallback: error`: with its prefill engine dead it answers 503 + Retry-After (the
    decode engine does not compute the prompt itself)."""
    cluster = two_models
    pd = {
        "connector": "shared_storage",
        "connector_config": {"shared_storage_path": str(tmp_path)},
        "fallback": "error",
    }
    models = [tiny_model("tiny-a"), tiny_model("tiny-c", deployment={"num_cpus": 0.25}, disaggregation=pd)]
    cluster.serve_deploy(app_config(models, batch=True))
    expected = {
        "OpenAIIngress",
        "LLMServer:tiny-a",
        "LLMServer:tiny-c",
        "LLMServer:tiny-c:prefill",
        "BatchAPI",
        "BatchRunner",
    }

    def two_hop_deployments() -> set[str]:  # the direct path's deployments leave once Serve has deleted them
        return set(cluster.dashboard_get("/api/serve/applications/")["applications"][APP]["deployments"])

    assert wait_for(lambda: two_hop_deployments() == expected, 120, 1), two_hop_deployments()
    # the Batch API through the ingress: a multipart upload keeps its content type; lines go to each model's own
    # deployment
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    lines = [
        {
            "custom_id": f"h{i}",
            "url": "/v1/completions",
            "body": {"model": ["tiny-a", "tiny-c"][i % 2], "prompt": f"x {i}", "max_tokens": 2},
        }
        for i in range(6)
    ]
    infile = client.files.create(
        file=("h.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())), purpose="batch"
    )
    batch = client.batches.create(input_file_id=infile.id, endpoint="/v1/completions", completion_window="1h")
    assert wait_for(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), 120)
    batch = client.batches.retrieve(batch.id)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert batch.status == "completed" and sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    assert {x["custom_id"]: x["response"]["body"]["model"] for x in out} == {
        x["custom_id"]: x["body"]["model"] for x in lines
    }
    for name in ["tiny-a", "tiny-c"]:
        r = httpx.post(
            cluster.base_url + "/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200 and r.json()["model"] == name
    # fallback: error, its prefill engine dead: a 503 + Retry-After naming the prefill pool; the other model answers
    ((prefill,),) = [
        probe(cluster.address, "each", APP, "LLMServer:tiny-c:prefill", "stats", "--replicas", "1").values()
    ]
    cores = engine_core_processes(prefill["pid"])
    assert cores, "the prefill replica should own a vLLM EngineCore process"
    for proc in cores:
        proc.kill()
    r = httpx.post(
        cluster.base_url + "/v1/completions", json={"model": "tiny-c", "prompt": "x", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert r.json()["error"]["type"] == "ServiceUnavailableError" and "prefill pool" in r.json()["error"]["message"]
    a = httpx.post(
        cluster.base_url + "/v1/completions", json={"model": "tiny-a", "prompt": "x", "max_tokens": 2}, timeout=60
    )
    assert a.status_code == 200, a.text
    # a dead engine on this path too: clean 503s from the replica's front through the ingress, then a new replica
    # (and a new prefill replica: until both are up every answer is that 503)
    before = probe(cluster.address, "each", APP, "LLMServer:tiny-c", "stats", "--replicas", "1")
    ((replica_id, stats),) = before.items()
    kill_engine_and_wait_for_answers(cluster.base_url, "tiny-c", stats["pid"], replica_id)
    after = probe(cluster.address, "each", APP, "LLMServer:tiny-c", "stats", "--replicas", "1")
    assert replica_id not in after
