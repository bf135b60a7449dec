"""Summit behind Ray Serve's HAProxy option (RAY_SERVE_ENABLE_HA_PROXY=1, the cluster files' choice).

HAProxy forwards each HTTP request straight to an ingress replica's own HTTP port instead of through Serve's
Python proxy actor. The ingress and everything behind it are unchanged; these tests check what depends on the
hop in front: streaming, response headers, OpenAI-shaped errors, and a client disconnect aborting the engine
request, and API keys checked at the HTTP entry. The shipped tiny-cpu.yaml (context raised as in conftest, API keys
switched on) runs on a private cluster of its own with HAProxy's files and ports private too.
"""

from __future__ import annotations

import openai
import pytest

from tests.local_cluster import LocalCluster, load_serve_config
from tests.replica_probe import probe
from tests.cpu.conftest import MAX_MODEL_LEN
from tests.cpu.engine_apps import APP, REPO, wait_for

MODEL = "tiny-llama"
# The dropped stream must outlast the disconnect's way to the engine on a loaded box (the openai client's close
# took seconds to reach the server in some runs, while the tiny model makes ~400 tokens/s).
DROPPED_TOKENS = MAX_MODEL_LEN - 100
API_KEY = "sk-summit-test-key"


@pytest.fixture(scope="module")
def behind_haproxy(tiny_model_dir):
    # the keys live in the cluster's environment (as a secret would), not in the Serve config
    cluster = LocalCluster(num_cpus=4, env={"SUMMIT_TINY_MODEL": str(tiny_model_dir),
                                            "SUMMIT_API_KEYS": f"other-key,{API_KEY}"}, haproxy=True)
    try:
        cluster.start()
        config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
        application = config["applications"][0]
        application["args"]["models"][0]["engine_kwargs"]["max_model_len"] = MAX_MODEL_LEN
        application["args"]["auth"] = {"api_keys_env": "SUMMIT_API_KEYS"}
        cluster.serve_deploy(config, ready_path="/health")  # /v1/models needs the key; the deploy waits for RUNNING
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def hclient(behind_haproxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=behind_haproxy.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def engine_stats(cluster: LocalCluster, method: str = "stats") -> dict:
    """The engine's own figures (vLLM's request count, or its generated-token counter), not what the client infers."""
    return next(iter(probe(cluster.address, "each", APP, f"LLMServer:{MODEL}", method, "--replicas", "1").values()))


def test_haproxy_is_what_answers(behind_haproxy):
    import psutil

    listeners = {c.pid for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == behind_haproxy.http_port}
    assert [psutil.Process(pid).name() for pid in listeners] == ["haproxy"]
    # Serve keeps its Python proxy only as HAProxy's fallback (on a port of its own).
    assert "HAProxyManager" in {a["class_name"] for a in behind_haproxy.alive_actors()}


def test_api_keys_are_required_on_every_openai_route(behind_haproxy, hclient):
    import httpx

    assert [m.id for m in hclient.models.list().data] == [MODEL]
    for key in [None, "wrong-key"]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}),
                                   ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),
                                   ("POST", "/tokenize", {"model": MODEL, "prompt": "x"})]:
            r = httpx.request(method, behind_haproxy.base_url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and "wrong-key" not in r.text
    assert httpx.get(behind_haproxy.base_url + "/health", timeout=30).status_code == 200  # load balancers' probe
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=behind_haproxy.base_url + "/v1", api_key="wrong-key", max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=1)
    logs = behind_haproxy.temp_dir / "session_latest" / "logs"
    assert not [f.name for f in logs.rglob("*") if f.is_file() and API_KEY.encode() in f.read_bytes()]  # never logged


def test_stream_headers_and_errors_pass_through(hclient):
    raw = hclient.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-request-id": "through-haproxy"})
    assert raw.headers["x-request-id"] == "through-haproxy" and raw.headers["x-summit-replica"]
    chunks = list(raw.parse())
    assert chunks[-1].usage.completion_tokens == 8
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    with pytest.raises(openai.NotFoundError) as e:
        hclient.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["type"] == "NotFoundError" and MODEL in e.value.body["message"]
    assert hclient.completions.create(model=MODEL, prompt="Still serving", max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_aborts_the_engine_request(behind_haproxy, hclient):
    assert wait_for(lambda: engine_stats(behind_haproxy)["num_unfinished_requests"] == 0, 60, interval_s=1)
    before = engine_stats(behind_haproxy, "token_counters")["generation_tokens"]
    stream = hclient.completions.create(model=MODEL, prompt="Dropped", max_tokens=DROPPED_TOKENS, stream=True,
                                        extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream):
        pass
    stream.close()  # the client goes away mid-stream: HAProxy closes its connection to the ingress replica
    assert wait_for(lambda: engine_stats(behind_haproxy)["num_unfinished_requests"] == 0, 60, interval_s=1)
    generated = engine_stats(behind_haproxy, "token_counters")["generation_tokens"] - before
    # Aborted: the engine stopped long before the tokens it would have made for a client that stayed.
    assert 3 <= generated < 0.75 * DROPPED_TOKENS, f"the engine generated {generated} tokens for a request dropped after 3"
