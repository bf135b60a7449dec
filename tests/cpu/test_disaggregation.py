"""The direct path (Serve's HAProxy -> the engine replica's own HTTP port; the route picker chooses each request's
replica by the body's model) and prefill/decode disaggregation over vLLM's shared-storage KV connector, on real
engines, in one app.

Three engines: `tiny-agg` (aggregated) and `tiny-pd` (disaggregated: `LLMServer:tiny-pd:prefill`, routed by
`kv_cache`, computes the prompt and stores its KV; the decode side, in the app's engine deployment beside tiny-agg,
loads it). Both models are the
same tiny model, so at temperature 0 their answers must match token for token. What the decode engine took from the
connector is read from its own counters (vLLM's external prefix-cache hits and prompt tokens by source), as Ray's
metrics endpoint exports them for its replica. Prompts are longer than one CPU KV block (128 tokens): shorter ones
transfer nothing.

The direct path: one base URL serves both models, each answer from a replica of the model the body names; nothing
sits between HAProxy and the engine replicas (no OpenAIIngress; HAProxy's config pins requests to the engine
replicas' ports); a body longer than HAProxy's routing buffer (its model cut off) is still answered by its model; a
client that leaves a stream aborts the engine request. Last, the app redeployed from a YAML whose models differ in
shape falls back to the two-hop path, where a dead engine is answered 503 + Retry-After and replaced, and a
disaggregated model with `fallback: error` answers 503 while its prefill engine is dead.
"""

from __future__ import annotations

import io
import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from deployments.http.response_ids import STORE_ENV, owner_of
from deployments.observability.watch import PD_PHASES, pd_phase_lines
from tests.cpu import engine_apps
from tests.cpu.engine_apps import APP, app_config, deployed, deployment_details, tiny_model, wait_for
from tests.engine_checks import (
    Throttle,
    engine_core_processes,
    kill_engine_and_wait_for_answers,
    model_engine_cores,
    paused,
)
from tests.replica_probe import probe

AGG, PD = "tiny-agg", "tiny-pd"
POOL = f"LLMServer:{AGG}+{PD}"
PREFILL = f"LLMServer:{PD}:prefill"
MODELS = [AGG, PD]
KV_BLOCK = 128
MAX_LEN = 2048


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def pd_app(tiny_model_dir, kv_dir):
    models = [
        tiny_model(AGG, {"max_model_len": MAX_LEN}),
        tiny_model(
            PD,
            {"max_model_len": MAX_LEN},
            disaggregation={
                "connector": "shared_storage",
                "connector_config": {"shared_storage_path": str(kv_dir)},
                "prefill": {"routing": {"policy": "kv_cache", "claim_s": 0}},  # no claims: only the KV events tell
            },
        ),
    ]
    with deployed(models, tiny_model_dir, haproxy=True, fast_metrics=True) as cluster:
        # In two full CI runs (never alone) the aggregated model's first completions right after the deploy answered
        # 404 for a while; wait until both models answer one before the tests start (FACTS.md: the 404 is open).
        def both_answer() -> bool:
            return all(
                httpx.post(
                    cluster.base_url + "/v1/completions", timeout=60, json={"model": m, "prompt": "Hi", "max_tokens": 1}
                ).status_code
                == 200
                for m in (AGG, PD)
            )

        assert wait_for(both_answer, 300, 2), "the models did not both answer within 300 s of the deploy"
        yield cluster


@pytest.fixture(scope="module")
def http(pd_app):
    with httpx.Client(base_url=pd_app.base_url, timeout=120) as client:
        yield client


def document(i: int) -> str:
    return engine_apps.document(i, title="Note", seed_offset=1000)  # texts of their own (the KV store is keyed by them)


def complete(http: httpx.Client, model: str, prompt: str, headers=None, **extra) -> httpx.Response:
    return http.post(
        "/v1/completions",
        headers=headers,
        json={"model": model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0, **extra},
    )


_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def replicas_by_model(cluster) -> dict[str, str]:
    """{replica_id: model}, as each engine replica reports it (LLMServer.stats through a Serve handle)."""
    answers = probe(cluster.address, "each", APP, POOL, "stats", "--replicas", "2")
    return {rid: s["model"] for rid, s in answers.items()}


def decode_counters(cluster) -> dict:
    """What the decode engine took from its KV connector and generated (vLLM's own counters) and the decode replica's
    count of disaggregated requests per phase (summit_pd_phase_seconds), read in its process: current as each
    request was answered, with no metrics export in between."""
    answers = probe(cluster.address, "each", APP, POOL, "stats", "--replicas", "2")
    (stats,) = [s for s in answers.values() if s["model"] == PD]
    recorded, by_source = stats["recorded"], stats["prompt_tokens_by_source"]
    return {
        "external_queries": recorded.get("vllm:external_prefix_cache_queries", 0),
        "external_hits": recorded.get("vllm:external_prefix_cache_hits", 0),
        "generation_tokens": stats["generation_tokens"],
        **{f"prompt_{source}": by_source.get(source, 0) for source in _SOURCES},
        **{f"pd_{phase}": recorded.get(f"summit:pd_phase_seconds_count:{phase}", 0) for phase in PD_PHASES},
    }


def test_the_engine_replicas_are_the_ingress_and_the_model_has_a_prefill_pool(pd_app):
    deployments = pd_app.dashboard_get("/api/serve/applications/")["applications"][APP]["deployments"]
    # no OpenAIIngress: no Python hop in the request path; the decode side is on the direct path
    assert set(deployments) == {POOL, PREFILL, "RoutePicker"}
    replicas = deployment_details(pd_app, POOL)["replicas"]
    assert len(replicas) == 2

    def pinned_servers() -> list[str]:
        """HAProxy's servers that the route picker's answer pins a request to."""
        config = next((pd_app.temp_dir / "h").rglob("haproxy.cfg")).read_text()
        assert "lua.route_via_ingress_request_router" in config
        return re.findall(r"use-server (\S+) if \{ var\(txn.ingress_request_router_target\)", config)

    assert wait_for(lambda: len(pinned_servers()) == 2, 30), pinned_servers()
    assert all(any(r["replica_id"] in s for r in replicas) for s in pinned_servers())


def test_decode_loads_the_prompt_kv_and_answers_as_aggregated(pd_app, http, kv_dir):
    prompt = document(1)
    r = http.post("/tokenize", json={"model": PD, "prompt": prompt})
    assert r.status_code == 200, r.text
    n = len(r.json()["tokens"])
    assert n > 2 * KV_BLOCK
    before = decode_counters(pd_app)
    ids = {m: f"phases-{m}-{uuid.uuid4().hex[:8]}" for m in (AGG, PD)}
    agg, pd = (complete(http, m, prompt, headers={"x-request-id": ids[m]}) for m in (AGG, PD))
    assert agg.status_code == 200 and pd.status_code == 200, (
        agg.status_code,
        agg.text[:300],
        pd.status_code,
        pd.text[:300],
    )
    assert pd.json()["choices"][0]["text"] == agg.json()["choices"][0]["text"]
    assert pd.json()["usage"]["prompt_tokens"] == n and pd.json()["usage"]["completion_tokens"] == 16
    after = decode_counters(pd_app)
    loaded = after["external_hits"] - before["external_hits"]
    computed = after["prompt_local_compute"] - before["prompt_local_compute"]
    whole_blocks = KV_BLOCK * ((n - 1) // KV_BLOCK)  # the connector moves whole blocks of all but the last token
    assert loaded == whole_blocks, (loaded, whole_blocks, after)
    assert computed == n - whole_blocks, (computed, after)  # only the tail past the last whole block is computed
    assert any(kv_dir.iterdir()), "the prefill engine stored no KV"
    # the decode replica measured the request's phases: one more of each in its metric, and its log line
    assert all(after[f"pd_{p}"] - before[f"pd_{p}"] == 1 for p in PD_PHASES), (before, after)
    lines = dict(pd_phase_lines(pd_app.temp_dir / "session_latest" / "logs" / "serve"))
    assert ids[AGG] not in lines, lines  # an aggregated request has no such phases
    phases = lines[ids[PD]]
    # an unstreamed answer comes at once: its stream phase is ~0 (no conjunct for it: `>= 0` could not fail)
    assert phases["prefill"] > 0 and phases["first_token"] > 0, phases


def test_streams_chat_n_and_stop_behave_as_aggregated(http):
    prompt = document(2)
    bodies = {
        m: {"model": m, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "stream": True}
        for m in (AGG, PD)
    }
    texts = {}
    for model, body in bodies.items():
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        texts[model] = "".join(
            httpx.Response(200, content=line[6:]).json()["choices"][0]["text"] for line in lines[:-1]
        )
    assert texts[PD] == texts[AGG]

    messages = [{"role": "user", "content": prompt}]
    chats = {
        m: http.post(
            "/v1/chat/completions", json={"model": m, "messages": messages, "max_tokens": 8, "temperature": 0}
        ).json()
        for m in (AGG, PD)
    }
    assert chats[PD]["choices"][0]["message"]["content"] == chats[AGG]["choices"][0]["message"]["content"]

    r = complete(http, PD, prompt, n=2, temperature=1.0)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1] and r.json()["usage"]["completion_tokens"] == 32
    assert choices[0]["text"] != choices[1]["text"]  # two draws from the random model's near-flat distribution

    # a stop string from the middle of the aggregated output (two characters not seen before it) ends PD's output
    # where it ends the aggregated one
    text = texts[AGG]
    at = next(i for i in range(4, len(text) - 2) if text[i : i + 2].strip() and text[i : i + 2] not in text[:i])
    r = complete(http, PD, prompt, max_tokens=12, stop=[text[at : at + 2]])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text[:at] and r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("extra, named", [({"echo": True}, "echo"), ({"prompt_logprobs": 1}, "prompt_logprobs")])
def test_what_decode_only_cannot_give_is_a_400_naming_it(http, extra, named):
    r = complete(http, PD, document(3), **extra)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and named in error["message"]
    assert complete(http, AGG, document(3), **extra).status_code == 200  # the aggregated model gives it


def test_a_bad_request_is_answered_as_vllm_answers_it(http):
    r = complete(http, PD, document(4), max_tokens=-1)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_one_base_url_serves_both_models_from_their_own_replicas(pd_app):
    owner = replicas_by_model(pd_app)
    assert sorted(owner.values()) == MODELS
    client = openai.OpenAI(base_url=pd_app.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
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
    r = httpx.post(pd_app.base_url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and AGG in r.json()["error"]["message"], (r.status_code, r.text[:300])


def test_a_body_cut_at_the_routing_buffer_is_answered_by_its_model(pd_app):
    owner = replicas_by_model(pd_app)
    # messages first, model last (as the openai client sends them): past 256 KiB HAProxy gives the picker no model
    long_text = "hello " * 50_000  # 300 KB of JSON, ~50k tokens: vLLM answers its own 400 (context MAX_LEN)
    for name in MODELS:
        body = json.dumps({"messages": [{"role": "user", "content": long_text}], "max_tokens": 1, "model": name})
        r = httpx.post(
            pd_app.base_url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400 and str(MAX_LEN) in r.json()["error"]["message"], r.text[:300]
        assert owner[r.headers["x-summit-replica"]] == name  # vLLM's answer, from an engine of the right model
        short = httpx.post(
            pd_app.base_url + "/v1/completions",
            json={"prompt": "x " * 500, "max_tokens": 1, "model": name},
            timeout=60,
        )
        assert short.status_code == 200 and owner[short.headers["x-summit-replica"]] == name


def test_client_leaving_a_stream_aborts_the_engine_request(pd_app, http):
    """Read from the engines' own counters (in their processes), not the client: how many tokens they made for a
    stream left after 3. The counter is read once it includes a later request's tokens (the sentinel, on the same
    engine after the stream ended there): a read that missed the stream's last steps would pass falsely."""

    def engines(method: str) -> dict:
        return probe(pd_app.address, "each", APP, POOL, method, "--replicas", "2")

    def generated() -> float:  # vLLM's counter, read in each engine's process
        return sum(s["generation_tokens"] for s in engines("stats").values())

    assert wait_for(lambda: sum(s["num_unfinished_requests"] for s in engines("stats").values()) == 0, 60)
    before = generated()
    # the engines crawl (paused but 2 ms of every 250) from before the stream starts until the replica has seen the
    # client leave: on a loaded box the tiny model made all its tokens while the client read its first three lines
    with Throttle(model_engine_cores(pd_app, "+".join(MODELS))):
        with httpx.stream(
            "POST",
            pd_app.base_url + "/v1/completions",
            timeout=60,
            json={"model": AGG, "prompt": "a", "max_tokens": MAX_LEN - 100, "ignore_eos": True, "stream": True},
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept referenced: a dropped iterator closes the response (the client leaves)
            for _ in range(3):
                next(lines)
        assert wait_for(lambda: sum(s["num_unfinished_requests"] for s in engines("stats").values()) == 0, 120)
    sentinel = 7
    assert complete(http, AGG, "The sentinel.", max_tokens=sentinel).status_code == 200
    assert wait_for(lambda: generated() >= before + sentinel + 1, 120, 1), (before, generated())
    made = generated() - before - sentinel
    # aborted: the engine stopped long before the tokens it would have made for a client that stayed
    assert 1 <= made < 0.5 * (MAX_LEN - 100), f"the engines made {made} tokens for a stream left after 3 lines"


def test_corrupt_or_missing_stored_kv_is_recomputed(pd_app, http, kv_dir):
    """Between the phases of a request: the shared-storage connector keys the stored KV by the prompt's tokens, and
    its prefill side does not store a prompt whose folder exists. So a prompt's folder emptied (KV missing) or its
    files overwritten (KV corrupt) after a first request is what the second request's decode finds."""
    for i, damage in enumerate(["missing", "corrupt"]):
        prompt = document(10 + i)
        seen = set(kv_dir.iterdir())
        expected = complete(http, AGG, prompt).json()["choices"][0]["text"]
        assert complete(http, PD, prompt).status_code == 200
        (folder,) = set(kv_dir.iterdir()) - seen
        for f in folder.iterdir():
            if damage == "missing":
                f.unlink()
            else:
                f.write_bytes(b"\0garbage" * 64)
        r = complete(http, PD, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
    assert complete(http, PD, document(20)).status_code == 200  # the decode engine is still well


def prefill_stats(cluster) -> dict:
    (stats,) = probe(cluster.address, "each", APP, PREFILL, "stats", "--replicas", "1").values()
    return stats


def test_the_prefill_pool_routes_by_what_its_engine_caches(pd_app, http):
    """The prefill pool routes by `kv_cache`: its replica indexes its engine's KV events (a document's blocks are there
    once the document was prefilled, without a gap in vLLM's event sequence), and the decode side's router sends the
    document's second prefill call by what that index holds (the router makes no claims here, `claim_s: 0`): a `hit`.
    The decisions are read as the decode replicas' routers counted them. Fails if the router ignores the index (it would
    count `new` twice) or the index never fills."""

    def decisions() -> dict[str, float]:  # as the decode replicas' routers counted them, in their processes
        answers = probe(pd_app.address, "each", APP, POOL, "stats", "--replicas", "2")
        made = [d for s in answers.values() for d in s["routing_decisions"]]
        return {
            o: sum(d["count"] for d in made if (d["model"], d["policy"], d["outcome"]) == (PD, "kv_cache", o))
            for o in ("hit", "spill", "new")
        }

    before = decisions()
    blocks = prefill_stats(pd_app)["kv_events"]["blocks"]
    doc = document(70)  # ~340 tokens: 2 whole blocks of 128
    assert complete(http, PD, doc).status_code == 200
    assert wait_for(lambda: prefill_stats(pd_app)["kv_events"]["blocks"] >= blocks + 2, 30), prefill_stats(pd_app)
    assert prefill_stats(pd_app)["kv_events"]["gaps"] == 0
    assert complete(http, PD, doc + "What does it say?").status_code == 200
    seen = decisions()
    assert sum(seen.values()) == sum(before.values()) + 2, (before, seen)  # both prefill calls, decided by KV cache
    assert seen["hit"] == before["hit"] + 1, (before, seen)  # the second found the document's blocks


def test_the_prefill_engine_holds_no_kv_once_its_requests_are_decoded(pd_app, http):
    with ThreadPoolExecutor(4) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda i: complete(http, PD, document(50 + i)), range(4)))
    assert wait_for(
        lambda: (s := prefill_stats(pd_app))["num_unfinished_requests"] == 0 and s["kv_cache_usage"] == 0,
        30,
        interval_s=2,
    ), prefill_stats(pd_app)


def test_a_client_leaving_during_its_prefill_cancels_it_there(pd_app, http):
    """The prefill engine is paused (SIGSTOP), so a request stays in its prefill; its client gives up before any
    byte: the decode replica's front cancels the prefill call (Serve logs it CANCELLED on the prefill replica), the
    prefill engine, resumed, ends with nothing unfinished and no KV held, and the decode engine never generates a
    token for it."""
    request_id = f"gone-in-prefill-{uuid.uuid4().hex[:8]}"
    logs = pd_app.temp_dir / "session_latest" / "logs" / "serve"

    def cancelled_in_prefill() -> bool:  # Serve's own line for the prefill replica's call, which the front cancelled
        return any(
            f"{request_id} -- CALL handle_http CANCELLED" in f.read_text(errors="replace")
            for f in logs.glob("replica_*prefill*.log")
        )

    before = decode_counters(pd_app)["generation_tokens"]
    cores = engine_core_processes(prefill_stats(pd_app)["pid"])
    assert cores
    for proc in cores:
        proc.suspend()
    try:
        # the front answers nothing before the prefill is done: the client gives up waiting and closes the connection
        with pytest.raises(httpx.ReadTimeout):
            http.post(
                "/v1/completions",
                headers={"x-request-id": request_id},
                timeout=httpx.Timeout(60, read=1.0),
                json={"model": PD, "prompt": document(70), "max_tokens": 16, "stream": True},
            )
        assert wait_for(cancelled_in_prefill, 30), "the prefill replica's call was not cancelled"
    finally:
        for proc in cores:
            proc.resume()
    assert wait_for(
        lambda: (s := prefill_stats(pd_app))["num_unfinished_requests"] == 0 and s["kv_cache_usage"] == 0,
        60,
        interval_s=2,
    ), prefill_stats(pd_app)
    assert decode_counters(pd_app)["generation_tokens"] == before  # the request never reached the decode engine
    assert complete(http, PD, document(71)).status_code == 200  # and the model serves on


def test_a_prefill_engine_killed_with_requests_in_flight_falls_back_to_the_decode_engine(pd_app, http):
    stats = prefill_stats(pd_app)
    cores = engine_core_processes(stats["pid"])
    assert cores
    n = 6
    expected = {i: complete(http, AGG, document(30 + i)).json()["choices"][0]["text"] for i in range(n)}
    before = decode_counters(pd_app)
    with ThreadPoolExecutor(n) as pool, paused(cores):  # the requests wait in the prefill engine until it dies
        answers = [pool.submit(complete, http, PD, document(30 + i)) for i in range(n)]
        # a bound, not a timing: at a load average of 50 three of the six were still on their way after 60 s
        held = wait_for(lambda: prefill_stats(pd_app)["num_unfinished_requests"] == n, 240, interval_s=1)
        assert held, f"the prefill engine never held the {n} requests: {prefill_stats(pd_app)}"
        for proc in cores:
            proc.kill()  # SIGKILL ends a stopped process
        answers = [a.result(timeout=120) for a in answers]  # never a hang
    for i, r in enumerate(answers):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[i]
    for i in range(2):  # while the prefill replica is dead or restarting: the decode engine computes the prompt
        r = complete(http, PD, document(40 + i))
        assert r.status_code == 200, r.text
    after = decode_counters(pd_app)
    assert after["prompt_local_compute"] - before["prompt_local_compute"] > 2 * KV_BLOCK

    # Serve replaces the prefill replica; the model is disaggregated again
    def replaced() -> bool:
        try:
            answers = probe(pd_app.address, "each", APP, PREFILL, "stats", "--replicas", "1")
        except RuntimeError:  # a call to the replica Serve is replacing timed out (CI: "Timed out resolving")
            return False
        return stats["replica_id"] not in answers

    assert wait_for(replaced, 300, interval_s=5)
    prompt = document(60)
    before = decode_counters(pd_app)
    assert complete(http, PD, prompt).status_code == 200
    assert decode_counters(pd_app)["external_hits"] > before["external_hits"]


@pytest.mark.long  # three more engines (the long tier, SUMMIT_TEST_LONG=1; tests/README.md)
def test_models_of_different_shapes_fall_back_to_two_hops(pd_app, tmp_path):
    """The module's cluster, its app redeployed (last: the direct-path tests are done) with models of two shapes and
    the Batch API: the app moves to the two-hop path, as a user's `serve deploy` of the changed YAML moves it.
    `tiny-c` is disaggregated with `fallback: error`: with its prefill engine dead it answers 503 + Retry-After (the
    decode engine does not compute the prompt itself)."""
    cluster = pd_app
    pd = {
        "connector": "shared_storage",
        "connector_config": {"shared_storage_path": str(tmp_path)},
        "fallback": "error",
    }
    models = [tiny_model("tiny-a"), tiny_model("tiny-c", deployment={"num_cpus": 0.25}, disaggregation=pd)]
    config = app_config(models, batch=True)
    config["applications"][0]["runtime_env"]["env_vars"][STORE_ENV] = "1"  # vLLM keeps responses (docs' way)
    cluster.serve_deploy(config)
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
    assert wait_for(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), 120), batch.id
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
    # a stored response through the ingress: retrieved from its model's deployment (the id names it), then continued
    first = client.responses.create(model="tiny-a", input="Hi", max_output_tokens=4)
    assert owner_of(first.id) is not None  # the replica got the application's runtime_env: named for it
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert client.responses.create(model="tiny-a", input="On", previous_response_id=first.id, max_output_tokens=4).id
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
