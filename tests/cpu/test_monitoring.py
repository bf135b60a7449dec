"""Monitoring on a real engine: readiness, metrics through Ray's metrics system and a real Prometheus (Debian's
`prometheus`) running the committed Grafana dashboard's queries, OpenTelemetry traces (the SDK's in-memory
exporter in the replica), and the Ray dashboard's Serve page in headless Chromium (Debian's `chromium`).

One app of its own (direct path, a route picker for prefix affinity, a bounded queue, traces kept in memory, the
Batch API on) on one tiny engine that runs 2 requests at once (the front lets 8 in: 6 wait in the engine) in a KV
cache of 1,024 tokens, so that a burst of long answers waits and preempts for many seconds (the tiny model is fast:
a shorter burst can fall between Ray's reports).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.cpu.engine_apps import APP, deployed, tiny_model, wait_for
from tests.engine_checks import Throttle, model_engine_cores
from tests.local_cluster import free_port
from tests.ray_metrics import by_label, scrape, total
from tests.replica_probe import probe

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-mon"
POOL = f"LLMServer:{MODEL}"
DASHBOARD = REPO / "monitoring/summit-dashboard.json"
# a shared prompt head longer than one CPU KV block (128 tokens), so that repeats hit vLLM's prefix cache
HEAD = " ".join(f"word{i}" for i in range(40))  # ~190 tokens
READY_LINE = f"Replica of {MODEL} ready: its engine answered a warm-up request"


class Readiness:
    """Polls /v1/models while the app deploys, and after each poll reads the replica's log: a poll that lists the
    model must come after the replica logged that its engine answered the warm-up (the line is written before Serve
    can route to the replica), and some polls must land while the replica runs but its engine has not yet answered
    (the engine's start is 25-35 s here) and find the model unlisted. A replica marked ready before its engine
    answered (the engine built in the background, say) is listed in that window and fails the test."""

    def __init__(self):
        self.listed_before_ready = 0  # polls that listed the model before the replica logged its engine answered
        self.unlisted_while_starting = 0  # polls in that window that did not list it
        self.first_completion: int | None = None
        self.polls = 0
        self.last = ""  # the last poll's outcome, for the failure message

    @staticmethod
    def replica_log(cluster) -> str | None:
        logs = list(cluster.temp_dir.glob("session_latest/logs/serve/replica_*.log"))
        return "".join(p.read_text(errors="replace") for p in logs) if logs else None

    def __call__(self, cluster) -> None:
        if self.first_completion is not None:
            return
        try:  # (HAProxy holds a request while no replica runs: such a poll times out, unlisted)
            models = httpx.get(cluster.base_url + "/v1/models", timeout=5)
            self.last = f"{models.status_code} {models.text[:300]}"
            listed = models.status_code == 200 and any(m["id"] == MODEL for m in models.json()["data"])
        except httpx.HTTPError as e:
            self.last, listed = repr(e), False
        log = self.replica_log(cluster)  # read after the poll: a listing seen must have been logged ready already
        engine_answered = log is not None and READY_LINE in log
        self.polls += 1
        if log is not None and not engine_answered:
            self.listed_before_ready += listed
            self.unlisted_while_starting += not listed
        if listed:
            r = httpx.post(
                cluster.base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, timeout=60
            )
            self.first_completion = r.status_code


READINESS = Readiness()


@pytest.fixture(scope="module")
def mon_app(tiny_model_dir):
    model = tiny_model(
        MODEL,
        {"max_model_len": 768, "kv_cache_memory_bytes": 512 << 10, "max_num_seqs": 2},
        {"max_ongoing_requests": 8, "max_queued_requests": 0, "overload_status_code": 429},
        routing={"policy": "prefix_affinity", "prefix_chars": 128},
    )
    with deployed(
        [model],
        tiny_model_dir,
        haproxy=True,
        batch=True,
        args={"monitoring": {"tracing": {"exporter": "memory"}}},
        while_waiting=READINESS,
        fast_metrics=True,
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(mon_app):
    return openai.OpenAI(base_url=mon_app.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_model_is_listed_only_once_its_engine_answers(mon_app):
    """Fails if /v1/models lists the model while its replica's engine is still starting (see Readiness), if the first
    completion after it is listed fails, or if the load-stage metrics or the warm-up log line are missing."""
    # the app may have become ready between two polls (and a poll on a busy box may time out): keep polling a while
    assert wait_for(lambda: READINESS(mon_app) or READINESS.first_completion is not None, 60, 1), (
        f"never listed in {READINESS.polls} polls; last: {READINESS.last}"
    )
    assert READINESS.listed_before_ready == 0, "listed before the replica's engine answered its warm-up"
    assert READINESS.unlisted_while_starting > 0, f"no poll landed while the engine started ({READINESS.polls} polls)"
    assert READINESS.first_completion == 200
    samples: list = []

    def ready_reported() -> bool:
        samples[:] = scrape(mon_app)
        return total(samples, "ray_summit_replica_load_stage", model=MODEL) == 3

    assert wait_for(ready_reported, 30)
    seconds = by_label(samples, "ray_summit_replica_load_seconds", "stage", model=MODEL)
    assert seconds.get("engine", 0) > 0 and seconds.get("warmup", 0) > 0, seconds


def _engine_counts(cluster) -> dict[str, float]:
    s = scrape(cluster)
    return {
        "e2e": total(s, "ray_vllm_e2e_request_latency_seconds_count", model_name=MODEL),
        "arrival": total(s, "ray_summit_arrival_to_engine_seconds_count", model=MODEL),
        "generated": total(s, "ray_vllm_generation_tokens_total", model_name=MODEL),
    }


# what the replica recorded in its own process (its stats' `recorded`), by the names _engine_counts gives Ray's export
_RECORDED = {
    "e2e": "vllm:e2e_request_latency_seconds_count",
    "arrival": "summit:arrival_to_engine_seconds_count",
    "generated": "vllm:generation_tokens",
    "request_generated": "vllm:request_generation_tokens_sum",
}


def _recorded(cluster) -> dict[str, float]:
    """The counts the model's replica recorded so far, read in its process (no metrics export in between)."""
    (stats,) = probe(cluster.address, "each", APP, POOL, "stats", "--replicas", "1").values()
    return {key: stats["recorded"].get(name, 0) for key, name in _RECORDED.items()}


def _stream(client, prompt: str, max_tokens: int) -> int:
    """Stream one completion; the number of tokens the client received (usage)."""
    usage = None
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        usage = chunk.usage or usage
    return usage.completion_tokens


def test_metrics_count_the_requests_and_tokens_the_client_saw(mon_app, client):
    """The replica records exactly the requests and tokens the client saw (vLLM's end-to-end count and generated
    tokens, Summit's arrivals, read in its process), and Ray's metrics endpoint exports those totals. Fails on a count
    short or over (a metric not recorded, recorded twice, or for another model) or one that never reaches Ray's
    endpoint. The waits are on the counts themselves: the engine records a request's end as its output goes out, and
    Ray's export lagged over 30 s on a box at half speed (load ~300)."""
    before = {k: v for k, v in _recorded(mon_app).items() if k in ("e2e", "arrival", "generated")}
    tokens = [_stream(client, f"{HEAD} question {i}", 12) for i in range(4)]
    want = {"e2e": before["e2e"] + 4, "arrival": before["arrival"] + 4, "generated": before["generated"] + sum(tokens)}
    assert wait_for(lambda: {k: _recorded(mon_app)[k] for k in want} == want, 30), (_recorded(mon_app), want)
    assert wait_for(lambda: _engine_counts(mon_app) == want, 120), (_engine_counts(mon_app), want)


def test_a_streamed_request_is_one_trace_under_the_clients_span(mon_app):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with httpx.stream(
        "POST",
        mon_app.base_url + "/v1/completions",
        timeout=60,
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        json={"model": MODEL, "prompt": f"{HEAD} traced", "max_tokens": 8, "stream": True},
    ) as r:
        assert r.status_code == 200
        returned = r.headers["traceparent"]
        body = r.read()
    assert body.rstrip().endswith(b"data: [DONE]")
    assert returned.startswith(f"00-{trace_id}-") and not returned.endswith(f"-{parent}-01")
    spans = _spans(mon_app, trace_id, 5)
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {
        "summit.request",
        "summit.route",
        "summit.queue",
        "summit.engine.prefill",
        "summit.engine.decode",
    }, spans
    root = by_name["summit.request"]
    assert root["parent_id"] == parent and returned.split("-")[2] == root["span_id"]
    assert all(s["trace_id"] == trace_id for s in spans)
    assert all(s["parent_id"] == root["span_id"] for s in spans if s is not root)
    route = by_name["summit.route"]["attributes"]
    assert route["summit.routing.policy"] == "prefix_affinity" and route["summit.routing.outcome"] in (
        "hit",
        "new",
        "spill",
    )
    assert route["summit.routing.replica"] == root["attributes"]["summit.replica"]
    prefill, decode = by_name["summit.engine.prefill"], by_name["summit.engine.decode"]
    assert (
        root["start_ns"]
        <= prefill["start_ns"]
        <= prefill["end_ns"]
        == decode["start_ns"]
        <= decode["end_ns"]
        <= root["end_ns"]
    )
    assert root["attributes"]["http.response.status_code"] == 200 and root["attributes"]["summit.aborted"] is False
    assert root["events"] == ["summit.end"]


def test_a_client_that_leaves_ends_its_trace_as_aborted(mon_app):
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    # The engine crawls until the trace is in: the stream still runs when the client leaves (at full speed a loaded
    # box let the whole answer reach HAProxy's buffers first, and the trace ended as a complete answer).
    with Throttle(model_engine_cores(mon_app, MODEL)):
        with httpx.stream(
            "POST",
            mon_app.base_url + "/v1/completions",
            timeout=60,
            headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b8-01"},
            json={"model": MODEL, "prompt": "leave early", "max_tokens": 700, "stream": True, "ignore_eos": True},
        ) as r:
            assert r.status_code == 200
            next(r.iter_bytes())  # the first token, then the client goes
        spans = _spans(mon_app, trace_id, 5, timeout_s=60)
    (root,) = [s for s in spans if s["name"] == "summit.request"]
    assert (
        root["attributes"]["summit.aborted"] is True
        and root["events"] == ["summit.abort"]
        and root["status"] == "ERROR"
    )


def _spans(cluster, trace_id: str, want: int, timeout_s: float = 30) -> list[dict]:
    found: list[dict] = []

    def enough() -> bool:
        found[:] = [
            s
            for a in probe(cluster.address, "each", APP, POOL, "recent_spans", trace_id, "--replicas", "1").values()
            for s in a["spans"]
        ]
        return len(found) >= want

    assert wait_for(enough, timeout_s, 1), found
    return found


@pytest.fixture(scope="module")
def prometheus(mon_app, tmp_path_factory):
    """Debian's Prometheus scraping the cluster every second through Ray's service-discovery file."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: run scripts/test_packages.sh as root (apt-get install prometheus)"
    sd_file = mon_app.temp_dir / "prom_metrics_service_discovery.json"
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": [str(sd_file)]}]}],
            }
        )
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=open(work / "log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _ok(url + "/-/ready"), 60), (work / "log").read_text()[-2000:]
        assert wait_for(lambda: _query(url, E2E) is not None, 60), "Prometheus has not scraped Ray's endpoints"
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _query(url: str, expr: str) -> float | None:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    result = r["data"]["result"]
    return sum(float(x["value"][1]) for x in result) if result else None


class _HeldAsExported:
    """Whether Prometheus holds `selector`'s sum as Ray's metrics endpoint exports it now (not 0); `last`: both."""

    def __init__(self, url: str, cluster, selector: str):
        self.url, self.cluster, self.selector = url, cluster, selector
        self.last: tuple = ()

    def __call__(self) -> bool:
        held, exported = _query(self.url, f"sum({self.selector})"), _exported(self.cluster, self.selector)
        self.last = (self.selector, held, exported)
        return held == exported > 0


def _exported(cluster, selector: str) -> float:
    """`selector`'s sum as Ray's metrics endpoint exports it now (`metric{label="value"}`)."""
    metric, key, value = re.fullmatch(r'(\w+)\{(\w+)="([^"]*)"\}', selector).groups()
    return total(scrape(cluster), metric, **{key: value})


def _series(url: str, expr: str, since: float) -> list[dict]:
    """`expr`'s series from 60 s before `since` to now, a point a second (Prometheus's range query)."""
    return httpx.get(
        url + "/api/v1/query_range",
        params={"query": expr, "start": since - 60, "end": time.time(), "step": 1},
        timeout=30,
    ).json()["data"]["result"]


def _peak(url: str, expr: str, since: float) -> float:
    return max(
        (float(v) for series in _series(url, expr, since) for _, v in series["values"] if v not in ("NaN", "+Inf")),
        default=0.0,
    )


def _panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (p["title"], t["expr"].replace("$__rate_interval", "2m").replace("$model", MODEL))
        for p in dashboard["panels"]
        for t in p["targets"]
    ]


E2E = f'ray_vllm_e2e_request_latency_seconds_count{{model_name="{MODEL}"}}'
# the tokens of each finished request (vLLM's per-request histogram, recorded with the end-to-end count). Not vLLM's
# per-step counter: a loaded box had Ray's export lose one of its reports for good (3,955 of 4,024 tokens after 30 s,
# the end-to-end count exact); the dashboard's token-rate panel reads that counter and is checked below
GENERATED = f'ray_vllm_request_generation_tokens_sum{{model_name="{MODEL}"}}'
WAITING = f'sum(ray_vllm_num_requests_waiting{{model_name="{MODEL}"}})'
ARRIVALS = f'ray_summit_arrival_to_engine_seconds_count{{model="{MODEL}"}}'
COUNTS = (E2E, GENERATED, ARRIVALS)


def test_prometheus_answers_every_dashboard_query_after_a_known_load(mon_app, client, prometheus):
    """Fails if a dashboard panel's query comes back empty after the load, if the replica's own counts of the load
    (requests, arrivals, tokens; read in its process) differ from what was sent, if Prometheus does not come to hold
    what Ray's metrics endpoint exports of them, or if the abort and waiting series never rise. The two are checked
    apart: a count Summit never recorded fails the first; a report Ray's export loses under load (Ray sends Summit's
    histograms as deltas; a lost one is lost for good, seen once on a loaded box) leaves Ray's endpoint and Prometheus
    short alike, which the second does not count against Summit."""
    start = time.time()
    aborts = lambda: total(scrape(mon_app), "ray_summit_client_aborts_total")  # noqa: E731
    aborted_before = aborts()
    # a client that leaves: the abort counter rises while Prometheus watches. Its engine crawls meanwhile, so the
    # stream still runs when the client leaves (the replica sees that on its next write; at full speed a loaded box
    # let the whole answer reach HAProxy's buffers first).
    with Throttle(model_engine_cores(mon_app, MODEL)):
        with httpx.stream(
            "POST",
            mon_app.base_url + "/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": "leave", "max_tokens": 500, "ignore_eos": True, "stream": True},
        ) as r:
            next(r.iter_bytes())
        assert wait_for(lambda: aborts() > aborted_before, 60), "the replica never counted the client's leaving"
    before = _recorded(mon_app)

    # A burst larger than the replica's bound (8 in the engine, none queued; the rest answered 429) of long answers
    # that outgrow the KV cache (2 x ~700 tokens in 1,024: preemptions), with prompts that share a head (prefix-cache
    # hits).
    def one(i: int) -> tuple[int, int]:
        for _ in range(3):
            r = httpx.post(
                mon_app.base_url + "/v1/completions",
                timeout=300,
                json={"model": MODEL, "prompt": f"{HEAD} burst {i}", "max_tokens": 500, "ignore_eos": True},
            )
            # 408: HAProxy had the headers but not the body within its wait for the route picker (5 s), on a
            # saturated 2-core box (HAProxy runs at the engines' priority: app/clusters/haproxy.py); a 503 that is
            # from HAProxy's route-picker step is HAProxy's own (the picker did not answer in time; fresh-clone runs
            # saw two, then one), OpenAI-shaped by app/clusters/haproxy.py. Nothing reached a replica: send it again.
            haproxys = r.status_code == 503 and "request router could not place" in r.text
            if r.status_code != 408 and not haproxys:
                break
        if r.status_code not in (200, 429):
            return r.status_code, r.text[:200]  # what answered it, for the assertion's message
        return r.status_code, (r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0)

    answers: list[tuple[int, int | str]] = []
    for burst in range(4):  # again until the bound was hit and Prometheus saw requests wait (CI: a burst's waiting
        # fell between Ray's 2 s reports once; arrivals can spread out on a busy box)
        with ThreadPoolExecutor(24) as pool:
            answers += pool.map(one, range(24 * burst, 24 * (burst + 1)))
        if any(status == 429 for status, _ in answers) and wait_for(
            lambda: _peak(prometheus, WAITING, start) > 0, 8, 1
        ):
            break
    ok = [n for status, n in answers if status == 200]
    assert {status for status, _ in answers} == {200, 429} and len(ok) >= 8, answers
    _run_batch(client)  # three lines of 8 tokens
    sent = {"e2e": len(ok) + 3, "arrival": len(ok), "request_generated": sum(ok) + 3 * 8}
    # vLLM's end-to-end count has the batch lines; Summit's arrivals do not: the replica answers a batch line through
    # vLLM's serving objects, past the front that times arrivals (docs/operations/monitoring.md)

    def grown() -> dict[str, float]:
        now = _recorded(mon_app)
        return {key: now[key] - before[key] for key in sent}

    assert wait_for(lambda: grown() == sent, 30), (grown(), sent)
    for selector in COUNTS:  # Prometheus holds what Ray exports, once both caught up with the load's last report
        held = _HeldAsExported(prometheus, mon_app, selector)
        assert wait_for(held, 60, 2), held.last
    end = time.time()  # Prometheus has scraped past the load (it holds the load's last report)
    empty = []
    for title, expr in _panel_queries():
        r = httpx.get(
            prometheus + "/api/v1/query_range",
            timeout=30,
            params={"query": expr, "start": start - 60, "end": end, "step": 1},
        ).json()
        assert r["status"] == "success", (title, expr, r)
        values = [float(v) for series in r["data"]["result"] for _, v in series["values"] if v not in ("NaN", "+Inf")]
        if not values or max(values) <= 0:
            empty.append((title, expr))
    assert not empty, empty


def _run_batch(client) -> None:
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": f"batch {i}", "max_tokens": 8, "ignore_eos": True},
            }
        )
        + "\n"
        for i in range(3)
    )
    upload = client.files.create(file=("in.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 120)


def test_the_ray_dashboard_serve_page_shows_the_app_in_chromium(mon_app, tmp_path):
    binary = shutil.which("chromium")
    assert binary, "chromium is not installed: run scripts/test_packages.sh as root (apt-get install chromium)"
    url = mon_app.dashboard_url + "/#/serve"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1400,1000",
        "--virtual-time-budget=15000",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run([binary, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=300).stdout
    assert MODEL in dom or POOL in dom or re.search(r">\s*summit\s*<", dom), dom[-3000:]
    shot = tmp_path / "ray-dashboard-serve.png"
    subprocess.run([binary, *flags, f"--screenshot={shot}", url], capture_output=True, timeout=300)
    from PIL import Image

    with Image.open(shot) as image:
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        # the rendered dashboard (logo, status badges, anti-aliased text), not a blank or one-message error page
        assert image.size == (1400, 1000) and len(colors) > 64, (image.size, len(colors))
