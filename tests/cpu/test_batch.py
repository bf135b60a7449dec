"""The OpenAI Batch API on the session app (real engine, direct path behind HAProxy), with the official client:
files, batches, validation, cancel, expiry, and exactly-once through a killed runner and a restarted application."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import openai
import pytest

from tests.cpu.conftest import MODEL
from tests.cpu.engine_apps import APP, haproxy_servers, wait_for
from tests.engine_checks import Throttle, model_engine_cores, paused

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def client(summit) -> openai.OpenAI:
    return openai.OpenAI(base_url=summit.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def completion_lines(n: int, max_tokens: int = 8, prefix: str = "req", **body) -> list[dict]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": MODEL,
                "prompt": f"Topic {i % 7}: the summit ridge in winter, part {i}",
                "max_tokens": max_tokens,
                "temperature": 0,
                **body,
            },
        }
        for i in range(n)
    ]


def upload(client: openai.OpenAI, lines: list, name: str = "in.jsonl"):
    data = b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def wait_status(client, batch_id: str, statuses: set[str], timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s} s: {batch.request_counts}")


def wait_progress(client, batch_id: str, low: float, total: int, timeout_s: float = 300):
    """Until at least `low` of the lines are done (the batch still running); the batch then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        counts = batch.request_counts
        if counts and counts.completed + counts.failed >= low * total:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not reach {low:.0%}: {batch.status} {batch.request_counts}")


def results(client, batch) -> tuple[list[dict], list[dict]]:
    out = client.files.content(batch.output_file_id).content.decode().splitlines() if batch.output_file_id else []
    err = client.files.content(batch.error_file_id).content.decode().splitlines() if batch.error_file_id else []
    return [json.loads(x) for x in out], [json.loads(x) for x in err]


def assert_exactly_once(client, batch, lines: list[dict]) -> tuple[list[dict], list[dict]]:
    out, err = results(client, batch)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines), "every input custom_id exactly once"
    assert batch.request_counts.total == len(lines)
    assert batch.request_counts.completed == len(out) and batch.request_counts.failed == len(err)
    return out, err


def test_batch_round_trip_with_logprobs_and_an_engine_error(client):
    lines = completion_lines(30, logprobs=2)
    lines[7]["body"]["max_tokens"] = -1  # vLLM answers 400: the line goes to the error file, the batch completes
    infile = upload(client, lines)
    assert infile.purpose == "batch" and infile.bytes > 0
    batch = client.batches.create(
        input_file_id=infile.id, endpoint="/v1/completions", completion_window="24h", metadata={"job": "round-trip"}
    )
    assert batch.status == "validating" and batch.metadata == {"job": "round-trip"}
    batch = wait_status(client, batch.id, {"completed", "failed"})
    assert batch.status == "completed", batch.errors
    out, err = assert_exactly_once(client, batch, lines)
    assert len(err) == 1 and err[0]["custom_id"] == "req-7" and err[0]["response"]["status_code"] == 400
    # a line vLLM's request model refuses is answered as online: through the front and vLLM's HTTP app
    with pytest.raises(openai.BadRequestError) as online_error:
        client.completions.create(**lines[7]["body"])
    assert err[0]["response"]["body"]["error"]["message"] == online_error.value.body["message"]
    first = next(x for x in out if x["custom_id"] == "req-0")
    choice = first["response"]["body"]["choices"][0]
    assert first["response"]["status_code"] == 200 and len(choice["logprobs"]["token_logprobs"]) == 8
    # the good lines ran in the replica's process through vLLM's serving objects: an HTTP round would have given vLLM
    # the line's request id (x-request-id), which names its answer
    for x in out:
        assert x["response"]["request_id"] not in x["response"]["body"]["id"], x
    # the same request online gives the same text at temperature 0
    online = client.completions.create(**lines[0]["body"])
    assert online.choices[0].text == choice["text"]
    # files: retrieve, list (paged), content, delete
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    page = client.files.list(limit=1)
    assert len(page.data) == 1 and page.has_more
    assert {f.id for f in client.files.list().data} >= {infile.id, batch.output_file_id, batch.error_file_id}
    assert any(b.id == batch.id for b in client.batches.list(limit=100).data)
    assert client.files.delete(batch.error_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.error_file_id)


def test_chat_batch(client):
    lines = [
        {
            "custom_id": f"chat-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4},
        }
        for i in range(4)
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_status(client, batch.id, {"completed", "failed"})
    out, err = assert_exactly_once(client, batch, lines)
    assert not err and all(x["response"]["body"]["object"] == "chat.completion" for x in out)


def test_bad_input_named_by_line_and_field(client):
    good = completion_lines(2)
    bad = [
        good[0],
        b"{not json",
        {**good[1], "custom_id": None},
        good[0],
        {**good[1], "custom_id": "u", "url": "/v1/embeddings"},
        {**good[1], "custom_id": "m", "body": {**good[1]["body"], "model": "no-such-model"}},
    ]
    batch = client.batches.create(
        input_file_id=upload(client, bad).id, endpoint="/v1/completions", completion_window="24h"
    )
    batch = wait_status(client, batch.id, {"failed", "completed"}, 60)
    assert batch.status == "failed"
    found = {(e.line, e.param) for e in batch.errors.data}
    assert found == {(2, None), (3, "custom_id"), (4, "custom_id"), (5, "url"), (6, "body.model")}
    assert all(f"line {e.line}" in e.message for e in batch.errors.data)
    # request-level errors: OpenAI-shaped 4xx from the client's view
    infile = upload(client, good)
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=infile.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=infile.id, endpoint="/v1/completions", completion_window="soon")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * ((1 << 20) + 10))), purpose="batch")
    assert too_large.value.status_code == 413 and "batch.max_file_bytes" in too_large.value.message
    too_many = upload(client, completion_lines(1001, prefix="many"))
    batch = client.batches.create(input_file_id=too_many.id, endpoint="/v1/completions", completion_window="24h")
    batch = wait_status(client, batch.id, {"failed"}, 60)
    assert batch.errors.data[0].code == "too_many_requests"


def test_batch_lines_make_room_for_online_requests(client, summit, engine_stats):
    """While an online request runs on the replica, batch lines hold at most `batch.online_share` of its engine's
    sequences (the session app: 0.02 of 64, one line); with no online request they take up to max_concurrency (8).
    The engine is paused, so what the replica let in stays in the engine to be counted."""
    lines = completion_lines(8, max_tokens=8, prefix="share")
    online_done = threading.Event()

    def online() -> None:
        try:
            client.completions.create(model=MODEL, prompt="An online question", max_tokens=8, temperature=0)
        finally:
            online_done.set()

    def held(n: int) -> bool:
        return engine_stats()["num_unfinished_requests"] == n

    with paused(model_engine_cores(summit, MODEL)):
        threading.Thread(target=online, daemon=True).start()
        assert wait_for(lambda: held(1), 60, 0.5), "the online request should reach the engine"
        beside = client.batches.create(
            input_file_id=upload(client, lines).id, endpoint="/v1/completions", completion_window="24h"
        )
        wait_status(client, beside.id, {"in_progress"}, 60)
        assert wait_for(lambda: held(2), 60, 0.5), "one batch line beside the online request"
        time.sleep(3)  # the other seven wait in the replica, not in the engine
        assert held(2), engine_stats()
    assert online_done.wait(60)
    beside = wait_status(client, beside.id, {"completed"}, 120)
    assert_exactly_once(client, beside, lines)
    time.sleep(2.5)  # past the share's quiet time after the online request
    alone = completion_lines(8, max_tokens=8, prefix="alone")
    with paused(model_engine_cores(summit, MODEL)):
        batch = client.batches.create(
            input_file_id=upload(client, alone).id, endpoint="/v1/completions", completion_window="24h"
        )
        assert wait_for(lambda: held(8), 60, 0.5), f"no online request: all eight in the engine ({engine_stats()})"
    batch = wait_status(client, batch.id, {"completed"}, 120)
    assert_exactly_once(client, batch, alone)


def test_cancel_keeps_finished_lines(client):
    # long enough that a cancel sent at 5 % lands well before the end on a loaded box (300 lines of 24 tokens once
    # all finished before the runner saw the cancel)
    lines = completion_lines(1000, max_tokens=32, prefix="cancel")
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_progress(client, batch.id, 0.05, len(lines))
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_status(client, batch.id, {"cancelled"}, 120)
    out, err = assert_exactly_once(client, batch, lines)
    assert 0.05 * len(lines) <= len(out) < len(lines)
    assert all(x["error"]["code"] == "batch_cancelled" for x in err) and err


def test_expiry_returns_what_finished(client, summit):
    """Once a line has finished, the engine is paused (SIGSTOP) past the batch's window: the batch expires with the
    finished lines in its output and every other line in its errors as batch_expired."""
    lines = completion_lines(400, max_tokens=64, prefix="expire", ignore_eos=True)
    batch = client.batches.create(
        input_file_id=upload(client, lines).id, endpoint="/v1/completions", completion_window="30s"
    )
    wait_progress(client, batch.id, 1 / len(lines), len(lines), timeout_s=30)
    with paused(model_engine_cores(summit, MODEL)):
        time.sleep(max(0, batch.created_at + 31 - time.time()))  # past the window with the engine paused
    batch = wait_status(client, batch.id, {"expired", "completed"}, 120)
    assert batch.status == "expired" and batch.expired_at
    out, err = assert_exactly_once(client, batch, lines)
    assert out and err and all(x["error"]["code"] == "batch_expired" for x in err)


def _runner_state(summit) -> dict:
    from tests.replica_probe import probe

    try:  # through a Ray driver in a subprocess (tests/cpu/conftest.py: engine_stats says why)
        return next(iter(probe(summit.address, "each", APP, "BatchRunner", "state", "--replicas", "1").values()))
    except RuntimeError as e:  # being replaced
        return {"pid": None, "error": str(e)}


def test_runner_killed_mid_batch_finishes_exactly_once(client, summit):
    """The batch runner is killed with lines in flight: the engine crawls from the batch's start and is paused once a
    fifth of the lines are done, so the kill lands mid-batch with lines held in the engine, whatever the box's load;
    the new runner finishes the batch, each line once."""
    assert _runner_state(summit)["pid"], "the runner should answer"  # the driver's handle made before the clock runs
    lines = completion_lines(48, max_tokens=16, prefix="kill", ignore_eos=True)
    cores = model_engine_cores(summit, MODEL)
    with Throttle(cores) as throttle:
        batch = client.batches.create(
            input_file_id=upload(client, lines).id, endpoint="/v1/completions", completion_window="24h"
        )
        before = wait_progress(client, batch.id, 0.2, len(lines)).request_counts
        throttle.hold()
        state = _runner_state(summit)
        assert state["batch"] == batch.id, (state, before)
        os.kill(state["pid"], signal.SIGKILL)  # with lines in flight, held in the paused engine
    assert before.completed + before.failed < 0.8 * len(lines), "the fault came too late to mean anything"
    assert wait_for(lambda: _runner_state(summit)["pid"] not in (None, state["pid"]), 240, 2)
    batch = wait_status(client, batch.id, {"completed"}, 600)
    out, err = assert_exactly_once(client, batch, lines)
    assert not err and batch.request_counts.completed > before.completed


def test_application_restarted_mid_batch_finishes_exactly_once(client, summit):
    """`serve shutdown` + `serve deploy` of the same YAML: the new application's runner finds the batch in the store.
    The engine crawls until a fifth of the lines are done, then is paused until the application is gone, so the lines
    in flight cannot end during the shutdown's drain: the new application must run them, each once."""
    import yaml

    lines = completion_lines(48, max_tokens=16, prefix="restart", ignore_eos=True)
    cores = model_engine_cores(summit, MODEL)  # found first: the state API takes seconds on 2 cores
    config = yaml.safe_load((summit.temp_dir / "serve-config.yaml").read_text())
    servers = haproxy_servers(summit)
    try:
        # the engine crawls from the batch's start (a run beside busy loops saw all 48 lines done at its first look),
        # then stops for good once a fifth is done; resumed after the shutdown: a core whose replica left then exits
        with Throttle(cores) as throttle:
            batch = client.batches.create(
                input_file_id=upload(client, lines).id, endpoint="/v1/completions", completion_window="24h"
            )
            before = wait_progress(client, batch.id, 0.2, len(lines)).request_counts
            throttle.hold()
            summit.serve_shutdown()
    finally:
        summit.serve_deploy(config)  # before any assertion: the session's later modules need the app
    assert before.completed + before.failed < 0.8 * len(lines), "the fault came too late to mean anything"
    # HAProxy names the new replica (and has reloaded) before the client asks through it again
    assert wait_for(lambda: haproxy_servers(summit) - servers, 120, 0.5), (servers, haproxy_servers(summit))
    time.sleep(3)
    batch = wait_status(client, batch.id, {"completed"}, 600)
    out, err = assert_exactly_once(client, batch, lines)
    assert not err and batch.request_counts.completed > before.completed
