"""Streams moved off a live replica (LLMServer.move_streams), on the real engine: with `kv_migration` the stream's KV
goes to the replica that goes on with it over vLLM's shared-storage connector (the other engine loads it instead of
computing it); a context under `kv_migration.min_tokens` is recomputed there. Either way the client's stream is the
uncut one, token for token (temperature 0), one stream id, one [DONE].

Where the feature and its fallback disagree: the other engine's own count of prompt tokens loaded through its KV
connector (vLLM's `prompt_tokens_by_source`, read live in the replica): the carried stream's continuation loads all
but its last block or two from the connector, a recomputed one loads none. Neither engine saw the moved context
before (the reference runs on the source replica; the example connector finds a prompt by its full length only).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.cpu.engine_apps import deployed, replica_ports, running_replicas, tiny_model, wait_for
from tests.engine_checks import Throttle, engine_core_processes
from tests.replica_probe import probe
from tests.resume_checks import parsed, read_stream

MODEL = "tiny-kv-move"
POOL = f"LLMServer:{MODEL}"
MIN_TOKENS = 256
BLOCK = 128  # a CPU engine's KV block (tokens)
TOKENS = 400


@pytest.fixture(scope="module")
def moving(tiny_model_dir, tmp_path_factory):
    storage = tmp_path_factory.mktemp("kv-migration")
    model = tiny_model(
        MODEL,
        {"max_num_seqs": 4, "max_model_len": 2048, "kv_cache_memory_bytes": 64 << 20},
        {"num_replicas": 2, "graceful_shutdown_timeout_s": 30},
        kv_migration={
            "connector": "shared_storage",
            "connector_config": {"shared_storage_path": str(storage)},
            "min_tokens": MIN_TOKENS,
        },
        stream_resume={},
    )
    with deployed([model], tiny_model_dir, haproxy=True) as cluster:
        assert wait_for(lambda: len(running_replicas(cluster, POOL)) == 2, 240, 1)
        yield cluster


def stats(cluster) -> dict[str, dict]:
    return probe(cluster.address, "each", "summit", POOL, "stats", "--replicas", "2")


def source_replica(cluster) -> tuple[str, str, list]:
    """One replica's own URL, its id and its engine core processes."""
    for host, port in replica_ports(cluster):
        r = httpx.post(
            f"http://{host}:{port}/v1/completions",
            json={"model": MODEL, "prompt": "Which?", "max_tokens": 1},
            timeout=60,
        )
        if r.status_code == 200:
            replica = r.headers["x-summit-replica"]
            actor = next(
                a for a in cluster.alive_actors() if a["class_name"].endswith(POOL) and a["name"].endswith(replica)
            )
            return f"http://{host}:{port}", replica, engine_core_processes(actor["pid"])
    raise AssertionError(replica_ports(cluster))


def body(prompt: str) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }


def test_a_moved_stream_carries_its_kv_and_a_short_one_is_recomputed(moving):
    url, source, cores = source_replica(moving)
    long_prompt = "Move me. " + " ".join(f"ridge {i} of the col" for i in range(60))
    short_prompt = "Short one."
    reference = {}
    for name, prompt in (("long", long_prompt), ("short", short_prompt)):
        with httpx.stream("POST", url + "/v1/completions", json=body(prompt), timeout=120) as r:
            assert r.status_code == 200
            reference[name] = parsed(r.iter_lines())
        assert len(reference[name]["ids"]) == TOKENS

    for name, prompt, events in (("long", long_prompt, 40), ("short", short_prompt, 4)):
        before = stats(moving)
        rid = f"kv-move-{name}-{time.time_ns()}"
        seen, moves = _move(moving, url, cores, prompt, rid, events, source)
        after = stats(moving)
        ref = reference[name]
        assert not seen["errors"] and seen["done"], seen["errors"]
        assert len(seen["chunk_ids"]) == 1, seen["chunk_ids"]
        assert seen["ids"] == ref["ids"] and seen["text"] == ref["text"], name
        assert seen["usage"]["completion_tokens"] == TOKENS
        (move,) = [m for m in moves if m["request_id"] == rid]
        context = move["context_tokens"]
        (target,) = [r for r in after if r != source]
        loaded = _source(after[target], "external_kv_transfer") - _source(before[target], "external_kv_transfer")
        computed = _source(after[target], "local_compute") - _source(before[target], "local_compute")
        print(f"{name}: moved at {context} tokens of context: {move}; the target loaded {loaded}, computed {computed}")
        if name == "long":
            # the plan: carried (its context is over min_tokens); the other engine loaded all but its last blocks
            assert context >= MIN_TOKENS and move["kv"] == "kv", move
            assert loaded >= context - 2 * BLOCK and computed < 2 * BLOCK + 8, (context, loaded, computed)
        else:
            assert context < MIN_TOKENS and move["kv"] == "recompute", move
            assert loaded == 0 and computed >= context - 1, (context, loaded, computed)


def _move(cluster, url, cores, prompt, request_id, events_before, source):
    """The stream read to its end, moved after `events_before` events while its engine crawls (it cannot end
    first); what the move did (the replicas' answers)."""
    with Throttle(cores) as throttle:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body(prompt), headers={"x-request-id": request_id}, timeout=120
        ) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            head = []
            while sum(line.startswith("data: {") for line in head) < events_before:
                head.append(next(lines))
            answer = probe(cluster.address, "call", "summit", POOL, source, "move_streams", request_id)
            assert answer["replica_id"] == source, answer
            throttle.release()  # decided: the stream goes on at full speed elsewhere
            return parsed(head + list(lines)), answer["moved"]


def _source(replica_stats: dict, source: str) -> int:
    return int(replica_stats["prompt_tokens_by_source"].get(source, 0))


def test_a_resumed_stream_whose_replica_dies_ends_in_a_clear_error_with_no_event_twice(moving):
    """A client resumes its dropped stream (stream_resume), and the replica that keeps it dies while the resumed
    stream runs: the resumed stream ends in a clear error — its connection cut where the dead process held it, or an
    error event where another replica relayed it — with each event once, in order, and a resume after that is
    answered 410 by the replica that is left (the stream went with its replica)."""
    url, source, cores = source_replica(moving)
    prompt = "Keep me. " + " ".join(f"col {i}" for i in range(40))
    with Throttle(cores):  # the stream is live throughout
        first = read_stream(url + "/v1/completions", body(prompt), {}, stop_after=5)
        stream_id = first.headers["x-summit-stream-id"]
        numbers, cut, done, errored = [], None, False, False
        try:
            with httpx.stream(
                "POST",
                moving.base_url + "/v1/completions",
                json=body(prompt),
                headers={"Last-Event-ID": first.last_id},
                timeout=120,
            ) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    done = done or line == "data: [DONE]"
                    errored = errored or line.startswith('data: {"error"')
                    if line.startswith("id: "):
                        numbers.append(int(line.rsplit(":", 1)[1]))
                        if len(numbers) == 3:
                            probe(moving.address, "kill", "summit", POOL, source)
        except httpx.HTTPError as e:
            cut = e
    every = first.numbers() + numbers
    assert every == list(range(1, len(every) + 1)), every  # no event twice, none skipped
    # a clear error either way; never an end that looks complete
    assert cut is not None or (errored and done), (cut, errored, done, len(every))

    def gone() -> bool:
        # one resume in a CI run (stop 72) got no answer in 120 s right after the kill; each try is bounded, and a try
        # without an answer counts as one more 5xx (the 410 must still come within the bound below)
        try:
            answer = read_stream(
                moving.base_url + "/v1/completions", None, {"Last-Event-ID": f"{stream_id}:{every[-1]}"}, timeout=20
            )
        except httpx.TimeoutException as e:
            seen.append((None, f"no answer within 20 s: {type(e).__name__}"))
            return False
        seen.append((answer.status, answer.body))
        return answer.status < 500  # HAProxy may still name the dead replica for a moment

    seen: list = []
    assert wait_for(gone, 120, 1), seen
    status, text = seen[-1]
    assert status == 410 and json.loads(text)["error"]["param"] == "Last-Event-ID", seen[-1]
