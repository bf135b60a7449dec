"""The two-hop path as a user meets it (Serve's proxy, the ingress deployment, two engine replicas, API keys on, real
engines): resumable streams (`stream_resume`) and routing on the engines' KV events (`routing.policy: kv_cache`).
The long tier (an app of its own: SUMMIT_TEST_LONG=1). CI covers the two-hop path's replica side of a resume on the
installed vLLM (test_migration.py), the ingress's pinning of a resume (tests/unit/test_ingress.py), and kv_cache on
the direct path (test_engine_features.py) and in a prefill pool (test_disaggregation.py), through the same router."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.cpu.engine_apps import APP, deployed, document, tiny_model, wait_for
from tests.engine_checks import engine_core_processes, held_streams
from tests.replica_probe import probe
from tests.resume_checks import read_stream, same_stream, text_of

pytestmark = pytest.mark.long

MODEL = "tiny-hops"
KEY, OTHER_KEY = "sk-summit-hops", "sk-summit-hops-2"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def hops_app(tiny_model_dir):
    model = tiny_model(
        MODEL, {"max_num_seqs": 8}, {"num_replicas": 2}, stream_resume={}, routing={"policy": "kv_cache", "claim_s": 0}
    )
    with deployed(
        [model],
        tiny_model_dir,
        env={"SUMMIT_API_KEYS": f"{KEY},{OTHER_KEY}"},
        args={"auth": {"api_keys_env": "SUMMIT_API_KEYS"}},
        ready_path="/health",
    ) as cluster:
        yield cluster


def test_a_dropped_chat_stream_resumes_through_the_ingress_on_its_replica(hops_app):
    """A temperature-0 chat stream dropped after its first event, half of them and all but 3, resumed twice each with
    `Last-Event-ID` and no body through Serve's proxy: the ingress pins each resume to the replica keeping the stream
    (of two), whose front answers the rest once; with the dropped part one stream (ids 1..N), the text of an uncut run.
    Another key gets 404. Fails if a resume ends on a replica that does not keep its stream (404), or the replica
    aborted the request when the proxy's client left (410)."""
    url = hops_app.base_url + "/v1/chat/completions"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about ridges."}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    uncut = read_stream(url, body, AUTH)
    n = len(uncut.events)
    assert uncut.done and n >= 10, (uncut.status, uncut.body, n)
    replicas = set()
    for cut in (1, n // 2, n - 3):
        first = read_stream(url, body, AUTH, stop_after=cut)
        assert len(first.events) == cut and not first.done, first
        replicas.add(first.headers["x-summit-replica"])
        for _ in range(2):
            rest = read_stream(url, None, {**AUTH, "last-event-id": first.last_id})
            assert rest.status == 200, (cut, rest.body)
            same_stream(first, rest)
            assert rest.done and text_of(first.events + rest.events) == text_of(uncut.events), cut
    other = read_stream(url, None, {"authorization": f"Bearer {OTHER_KEY}", "last-event-id": first.last_id})
    assert other.status == 404 and json.loads(other.body)["error"]["param"] == "Last-Event-ID", other.body
    print(f"streams kept by {sorted(replicas)}")


def complete(app, prompt: str) -> str:
    """A short temperature-0 completion; the replica that answered it."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(app.base_url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-summit-replica"]


def test_kv_cache_routing_on_the_two_hop_path_sends_a_document_back_to_the_replica_that_cached_it(hops_app):
    """kv_cache through the ingress's handle, where the engines' KV events and the router's fallback disagree (as
    test_engine_features.py's direct-path case): each document is first sent while the other replica holds a stream
    with its engine paused, so it goes by load to the idle one (the control, asserted); the router makes no claims here
    (`claim_s: 0`), so only the engines' KV events tell where a document is, and each follow-up, sent once the
    replicas' indexes hold the documents, must go there. With the index ignored
    (tests/mutations/kv-index-ignored.patch) the follow-ups go by the first block's hash: all 6 documents' replicas
    found 1 time in 64."""

    def indexed() -> dict[str, int]:
        stats = probe(hops_app.address, "each", APP, f"LLMServer:{MODEL}", "stats", "--replicas", "2")
        return {replica: s["kv_events"]["blocks"] for replica, s in stats.items()}

    stats = probe(hops_app.address, "each", APP, f"LLMServer:{MODEL}", "stats", "--replicas", "2")
    pids = {replica: s["pid"] for replica, s in stats.items()}
    before = {replica: s["kv_events"]["blocks"] for replica, s in stats.items()}
    docs = [document(i, words=300, title="Two hops") for i in range(6)]
    homes, busy = [], []
    for i, doc in enumerate(docs):
        hold = {"model": MODEL, "prompt": f"Hold this replica {i}.", "max_tokens": 500, "ignore_eos": True}
        with httpx.Client(base_url=hops_app.base_url, headers=AUTH, timeout=120) as h, held_streams(h) as held:
            busy.append(held.open("/v1/completions", hold))
            held.pause(engine_core_processes(pids[busy[-1]]))  # one ongoing there, however slow the box
            homes.append(complete(hops_app, doc))
    assert all(home != held for home, held in zip(homes, busy)), (homes, busy)  # by load: the idle replica

    # ~460 tokens: 3 blocks of 128 for each document, in its replica's index (which the router follows)
    def all_indexed() -> bool:
        now = indexed()
        return all(now[h] >= before[h] + 3 * homes.count(h) for h in set(homes))

    assert wait_for(all_indexed, 60, 1), (before, indexed())
    again = [[complete(hops_app, doc + f"Question {q}: why?") for q in range(2)] for doc in docs]
    assert again == [[home, home] for home in homes], (homes, again)
