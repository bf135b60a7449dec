"""The direct path's HTTP entries, safe by default: API keys and loopback.

On the direct path (Serve's HAProxy, RAY_SERVE_ENABLE_HA_PROXY=1) HAProxy forwards each request to the engine
replica's own HTTP port; the session app (tests/cpu/conftest.py) runs the OpenAI, error and abort tests there.
This module checks what every entry must refuse: no key or a wrong one on every OpenAI route, at HAProxy and at
each replica's own port; and that nothing listens beyond loopback (HAProxy's stats and metrics ports included,
app/clusters/haproxy.py). The shipped tiny-cpu.yaml (API keys switched on) runs on a private cluster of its own.
"""

from __future__ import annotations

import math
import time

import openai
import psutil
import pytest

from tests.cpu.conftest import MAX_MODEL_LEN
from tests.cpu.engine_apps import APP, REPO, replica_ports, serve_log_matches, wait_for
from tests.local_cluster import LocalCluster, load_serve_config
from tests.replica_probe import probe

MODEL = "tiny-llama"
# The dropped stream must outlast the disconnect's way to the engine on a loaded box (the openai client's close
# took seconds to reach the server in some runs, while the tiny model makes ~400 tokens/s).
DROPPED_TOKENS = MAX_MODEL_LEN - 100
API_KEY = "sk-summit-test-key"
LIMITED_KEY = "sk-summit-limited"  # the key the rate-limit test spends (each key has its own limits)
# the other tests' requests stay well inside these
RATE_LIMIT = {"requests_per_minute": 20, "tokens_per_minute": 100_000}


@pytest.fixture(scope="module")
def behind_haproxy(tiny_model_dir):
    # the keys live in the cluster's environment (as a secret would), not in the Serve config
    cluster = LocalCluster(
        num_cpus=4,
        env={"SUMMIT_TINY_MODEL": str(tiny_model_dir), "SUMMIT_API_KEYS": f"other-key,{API_KEY},{LIMITED_KEY}"},
        haproxy=True,
    )
    try:
        cluster.start()
        config = load_serve_config(REPO / "serve_configs/tiny-cpu.yaml")
        application = config["applications"][0]
        application["args"]["models"][0]["engine_kwargs"]["max_model_len"] = MAX_MODEL_LEN
        application["args"]["auth"] = {"api_keys_env": "SUMMIT_API_KEYS", "rate_limit": RATE_LIMIT}
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
    def listeners(attribute: str) -> set:
        """`name` or `nice` of each process listening on the app's HTTP port (after a reload the old HAProxy
        listens beside the new one until it leaves)."""
        found = set()
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == behind_haproxy.http_port:
                try:
                    found.add(getattr(psutil.Process(c.pid), attribute)())
                except psutil.NoSuchProcess:
                    pass  # an old HAProxy that left meanwhile
        return found

    assert wait_for(lambda: listeners("name") == {"haproxy"}, 30, 0.5), listeners("name")
    # in the request path at the engines' priority, not at Ray's worker niceness (15) that Serve starts it with
    assert listeners("nice") == {0}, listeners("nice")
    # Serve keeps its Python proxy only as HAProxy's fallback (on a port of its own).
    assert "HAProxyManager" in {a["class_name"] for a in behind_haproxy.alive_actors()}


def test_api_keys_are_required_on_every_openai_route(behind_haproxy, hclient):
    import httpx

    assert [m.id for m in hclient.models.list().data] == [MODEL]
    for key in [None, "wrong-key"]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"model": MODEL, "prompt": "x"}),
            ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),
            ("POST", "/tokenize", {"model": MODEL, "prompt": "x"}),
        ]:
            r = httpx.request(method, behind_haproxy.base_url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and "wrong-key" not in r.text
    assert httpx.get(behind_haproxy.base_url + "/health", timeout=30).status_code == 200  # load balancers' probe
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=behind_haproxy.base_url + "/v1", api_key="wrong-key", max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=1
        )
    logs = behind_haproxy.temp_dir / "session_latest" / "logs"
    assert not [f.name for f in logs.rglob("*") if f.is_file() and API_KEY.encode() in f.read_bytes()]  # never logged


def test_each_key_is_rate_limited_on_its_own_with_openai_429s(behind_haproxy, hclient):
    """auth.rate_limit through the RateLimiter deployment: a key over its requests per minute gets OpenAI's 429 with
    Retry-After (the official client raises RateLimitError), another key is still served, and a request whose
    tokens can never fit the key's tokens per minute is refused at once."""
    import httpx

    headers = {"authorization": f"Bearer {LIMITED_KEY}"}
    rpm = RATE_LIMIT["requests_per_minute"]
    answers, start = [], time.monotonic()
    while len(answers) < 5 * rpm and (not answers or answers[-1].status_code == 200):  # until the first refusal
        answers.append(
            httpx.post(
                behind_haproxy.base_url + "/tokenize", json={"model": MODEL, "prompt": "x"}, headers=headers, timeout=30
            )
        )
    refused_at = time.monotonic()
    elapsed = refused_at - start
    statuses = [r.status_code for r in answers]
    assert statuses[-1] == 429 and set(statuses[:-1]) == {200}, statuses
    # the bucket holds a minute's requests and refills one every 60/rpm s: the key got at least its bucket, and no
    # more than what refilled meanwhile (however slowly this box sent them)
    assert rpm <= len(answers) - 1 <= rpm + math.ceil(elapsed / (60 / rpm)), (len(answers), elapsed)
    refused = answers[-1]
    assert (
        refused.json()["error"]["type"] == "RateLimitError"
        and "requests per minute (20)" in refused.json()["error"]["message"]
    )
    assert 1 <= int(refused.headers["retry-after"]) <= 3 and LIMITED_KEY not in refused.text
    limited = openai.OpenAI(base_url=behind_haproxy.base_url + "/v1", api_key=LIMITED_KEY, max_retries=0, timeout=60)
    served = 0
    with pytest.raises(openai.RateLimitError):
        # the official client's turn: refused too, after at most the requests refilled since the refusal above (one
        # every 60/rpm s; a CI run's loaded box took longer than that to make the client and send)
        while served < 5:
            limited.completions.create(model=MODEL, prompt="x", max_tokens=1)
            served += 1
    refills = math.ceil((time.monotonic() - refused_at) / (60 / rpm))
    assert served <= refills, (served, refills)
    assert hclient.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.RateLimitError, match="exceed the key's 100000 tokens per minute"):
        hclient.completions.create(model=MODEL, prompt="x", max_tokens=200_000)


def test_requests_are_served_while_the_rate_limiter_does_not_answer(behind_haproxy):
    """The RateLimiter replica paused (SIGSTOP): a key that is over its limit is served rather than every key refused
    (the front waits a second for the limiter, logs that it is unreachable and lets requests go on); once it answers
    again, the key is refused again."""
    import httpx

    headers = {"authorization": f"Bearer {LIMITED_KEY}"}

    def ask() -> httpx.Response:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        return httpx.post(behind_haproxy.base_url + "/v1/completions", json=body, headers=headers, timeout=60)

    while (r := ask()).status_code == 200:  # spend the key's bucket (the test above may have left it refilling)
        pass
    assert r.status_code == 429, r.text
    (limiter,) = [a for a in behind_haproxy.alive_actors() if a["class_name"].endswith(":RateLimiter")]
    proc = psutil.Process(limiter["pid"])
    proc.suspend()
    try:
        served = ask()
    finally:
        proc.resume()
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 1, served.text
    assert serve_log_matches(behind_haproxy, "rate limiter not reachable"), "the front did not say why it served"
    assert wait_for(lambda: ask().status_code == 429, 30, 0.2)  # the limiter answers again: the key is refused


def test_batch_files_and_batches_belong_to_their_key(behind_haproxy, hclient):
    """With keys on, a file or batch is its key's: another valid key neither lists nor reads it; the runner's own
    calls to the engine (through a Serve handle) need no key and the batch completes."""
    import io
    import json
    import time

    lines = [
        {"custom_id": f"k{i}", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "x", "max_tokens": 2}}
        for i in range(3)
    ]
    infile = hclient.files.create(
        file=("k.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())), purpose="batch"
    )
    batch = hclient.batches.create(input_file_id=infile.id, endpoint="/v1/completions", completion_window="1h")
    other = openai.OpenAI(base_url=behind_haproxy.base_url + "/v1", api_key="other-key", max_retries=0, timeout=60)
    assert infile.id not in {f.id for f in other.files.list().data}
    with pytest.raises(openai.NotFoundError):
        other.files.content(infile.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=infile.id, endpoint="/v1/completions", completion_window="1h")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=behind_haproxy.base_url + "/v1", api_key="wrong-key", max_retries=0).files.list()
    deadline = time.monotonic() + 120
    while (batch := hclient.batches.retrieve(batch.id)).status not in (
        "completed",
        "failed",
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    assert infile.id in {f.id for f in hclient.files.list().data}


def test_each_replicas_own_port_wants_the_key_too(behind_haproxy):
    import httpx

    ports = replica_ports(behind_haproxy)
    assert ports
    for host, port in ports:
        url = f"http://{host}:{port}"
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
        ok = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
            headers={"authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def fallback_proxy_port(cluster: LocalCluster) -> int:
    """The port of HAProxy's `backup` server (Serve's fallback proxy, which answers while an app has no ready
    replica): the cluster's own, never Serve's machine-wide default 8500 (app/clusters/job_env.haproxy_env)."""
    import re

    config = next((cluster.temp_dir / "h").rglob("haproxy.cfg")).read_text()
    ports = {int(p) for p in re.findall(r"server SERVE_PROXY_ACTOR-fallback\S* \S+:(\d+) check backup", config)}
    assert ports == {int(cluster.env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"])}, config
    return ports.pop()


def test_no_http_entry_listens_beyond_loopback(behind_haproxy):
    """HAProxy (client port, stats, metrics), the replicas' own HTTP ports and the cluster's own fallback proxy (its
    port from the cluster's environment: another cluster on the machine would share Serve's default) bind loopback;
    from the machine's other addresses, if it has any, each of those ports refuses the connection. (Not covered, and
    not Summit's to move: every Serve replica's inter-deployment gRPC server binds [::]:0 in Ray 2.60 —
    docs/operations/security.md.)"""
    import socket

    import psutil

    listening = {c.laddr.port: c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid}

    def name(pid: int) -> str | None:
        try:
            return psutil.Process(pid).name()
        except psutil.NoSuchProcess:  # a process that has exited since the list (another test's, a replaced replica)
            return None

    haproxy = {port for port, c in listening.items() if name(c.pid) == "haproxy"}
    assert {
        behind_haproxy.http_port,
        int(behind_haproxy.env["RAY_SERVE_HAPROXY_STATS_PORT"]),
        int(behind_haproxy.env["RAY_SERVE_HAPROXY_METRICS_PORT"]),
    } <= haproxy
    fallback = fallback_proxy_port(behind_haproxy)
    assert fallback in listening, f"the fallback proxy's port {fallback} (HAProxy's backup server) is not listening"
    entries = haproxy | {port for _, port in replica_ports(behind_haproxy)} | {fallback}
    wide = [
        (port, listening[port].laddr.ip)
        for port in entries
        if port in listening and listening[port].laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    ]
    assert not wide, f"HTTP entries listening beyond loopback: {wide}"
    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    for address in others:
        for port in entries:
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((address, port)) != 0, f"{address}:{port} accepted a connection"
