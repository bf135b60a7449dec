"""Resumable streams (`stream_resume`) on the two-hop path as a user meets it: Serve's proxy, the ingress deployment,
two engine replicas, API keys on, real engines. The long tier (an app of its own: SUMMIT_TEST_LONG=1); CI covers the
two-hop path's replica side on the installed vLLM (test_migration.py) and the ingress's pinning of a resume to its
replica (tests/unit/test_ingress.py)."""

from __future__ import annotations

import json

import pytest

from tests.cpu.engine_apps import deployed, tiny_model
from tests.resume_checks import read_stream, same_stream, text_of

pytestmark = pytest.mark.long

MODEL = "tiny-hops"
KEY, OTHER_KEY = "sk-summit-hops", "sk-summit-hops-2"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def hops_app(tiny_model_dir):
    model = tiny_model(MODEL, {"max_num_seqs": 8}, {"num_replicas": 2}, stream_resume={})
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
