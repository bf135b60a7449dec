"""The Batch API's pure parts: the durable store, input-line validation, and the runner core (with a fake `send`)."""

from __future__ import annotations

import asyncio
import json

import pytest

from deployments.batch.core import Answer, Unavailable, run_lines
from deployments.batch.lines import Line, grouped, parse_lines, window_seconds
from deployments.batch.store import BatchStore, Conflict, NotFound
from tests.aio import until

URL = "/v1/completions"


def jsonl(*objs) -> bytes:
    return b"\n".join(o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs) + b"\n"


def req(custom_id, prompt="hi", model="m", **extra):
    return {"custom_id": custom_id, "method": "POST", "url": URL, "body": {"model": model, "prompt": prompt, **extra}}


@pytest.fixture
def store(tmp_path):
    s = BatchStore(tmp_path / "db" / "batch.sqlite3", tmp_path / "files")
    yield s
    s.close()


def test_files_round_trip_pages_owners_and_delete(store):
    ids = [store.add_file([f"file {i}".encode()], f"f{i}.jsonl", "batch", owner="alice")["id"] for i in range(5)]
    store.add_file([b"other"], "x.jsonl", "batch", owner="bob")
    assert store.file_path(ids[0]).read_bytes() == b"file 0"
    first = store.list_files("alice", limit=2)
    assert [f["id"] for f in first.data] == ids[::-1][:2] and first.has_more
    rest = store.list_files("alice", after=first.data[-1]["id"], limit=10)
    assert [f["id"] for f in rest.data] == ids[::-1][2:] and not rest.has_more
    assert [f["id"] for f in store.list_files("alice", order="asc", limit=10).data] == ids
    with pytest.raises(NotFound):
        store.get_file(ids[0], owner="bob")  # another key's file is not there for it
    assert store.delete_file(ids[1], "alice")["deleted"]
    assert not store.file_path(ids[1]).exists()
    with pytest.raises(NotFound):
        store.get_file(ids[1], "alice")


def test_results_recorded_once_and_files_in_input_order(store, tmp_path):
    f = store.add_file([b"{}"], "in.jsonl", "batch")
    batch = store.add_batch("", f["id"], URL, 3600, "1h", {"k": "v"})
    store.update_batch(batch["id"], status="in_progress", request_counts={"total": 3, "completed": 0, "failed": 0})
    counts = store.record(batch["id"], [("c", 3, True, {"custom_id": "c"}), ("a", 1, True, {"custom_id": "a"})])
    assert counts == {"completed": 2, "failed": 0}
    # a line run again after a crash: its first result stays
    store.record(batch["id"], [("a", 1, False, {"custom_id": "a", "again": True}), ("b", 2, False, {"custom_id": "b"})])
    assert store.get_batch(batch["id"])["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    done = store.finalize(batch["id"], "completed")
    assert done["status"] == "completed" and done["completed_at"] and done["metadata"] == {"k": "v"}
    out = [json.loads(x) for x in store.file_path(done["output_file_id"]).read_text().splitlines()]
    err = [json.loads(x) for x in store.file_path(done["error_file_id"]).read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["a", "c"] and "again" not in out[0]
    assert [x["custom_id"] for x in err] == ["b"]
    # all of it survives a new store on the same paths (a restarted replica)
    again = BatchStore(tmp_path / "db" / "batch.sqlite3", tmp_path / "files")
    assert again.get_batch(batch["id"])["output_file_id"] == done["output_file_id"]
    assert again.finished_ids(batch["id"]) == {"a", "b", "c"}
    assert again.add_file([b"x"], "y", "batch")["id"] not in {f["id"], done["output_file_id"]}


def test_cancel_only_while_running(store):
    f = store.add_file([b"{}"], "in.jsonl", "batch")
    batch = store.add_batch("", f["id"], URL, 60, "1m", None)
    assert store.cancel(batch["id"])["status"] == "cancelling"
    store.finalize(batch["id"], "cancelled")
    assert store.cancel(batch["id"])["status"] == "cancelled"  # idempotent
    other = store.add_batch("", f["id"], URL, 60, "1m", None)
    store.finalize(other["id"], "completed")
    with pytest.raises(Conflict):
        store.cancel(other["id"])
    assert [b["id"] for b in store.active_batches()] == []


def test_retention_deletes_old_files(tmp_path):
    s = BatchStore(tmp_path / "b.sqlite3", tmp_path / "files", retention_s=3600)
    f = s.add_file([b"x"], "a", "batch")
    assert f["expires_at"] is not None
    assert s.expire_files() == 0
    s._db.execute("UPDATE files SET expires_at = 0")  # an hour on
    assert s.expire_files() == 1
    with pytest.raises(NotFound):
        s.get_file(f["id"])


def test_each_bad_line_named_with_its_field():
    data = jsonl(
        req("ok"),
        b"{not json",
        {"method": "POST", "url": URL, "body": {}},
        req("ok"),
        {**req("u"), "url": "/v1/embeddings"},
        req("m", model="nope"),
        {**req("s"), "body": {"model": "m", "stream": True}},
        {**req("b"), "body": "text"},
    )
    lines, errors = parse_lines(data, URL, ["m"], 100)
    assert [x.custom_id for x in lines] == ["ok"]
    found = {(e.line, e.param, e.code) for e in errors}
    assert found == {
        (2, None, "invalid_json_line"),
        (3, "custom_id", "invalid_request"),
        (4, "custom_id", "duplicate_custom_id"),
        (5, "url", "invalid_request"),
        (6, "body.model", "model_not_found"),
        (7, "body.stream", "invalid_request"),
        (8, "body", "invalid_request"),
    }
    assert all(f"line {e.line}" in e.message for e in errors)
    _, errors = parse_lines(jsonl(*(req(str(i)) for i in range(5))), URL, ["m"], 4)
    assert errors[0].code == "too_many_requests"
    _, errors = parse_lines(jsonl(req("x")), "/v1/chat/completions", ["m"], 10)
    assert errors[0].param == "url" and "endpoint" in errors[0].message


def test_one_model_is_the_default_and_window_parsing():
    lines, errors = parse_lines(jsonl({"custom_id": "a", "url": URL, "body": {"prompt": "x"}}), URL, ["only"], 10)
    assert not errors and lines[0].model == "only"
    assert window_seconds("24h") == 86400 and window_seconds("90s") == 90
    for bad in ("", "24", "0h", "-1h", "1w"):
        with pytest.raises(ValueError):
            window_seconds(bad)


def test_grouping_runs_shared_prefixes_together():
    lines = [Line(i, str(i), URL, {"model": "m", "prompt": p}) for i, p in enumerate(["b x", "a y", "b y", "a x"])]
    assert [x.body["prompt"] for x in grouped(lines)] == ["a x", "a y", "b x", "b y"]


def test_core_bounds_concurrency_retries_busy_answers_and_stops():
    """Lines go in groups of one model (at most group_size); a line answered 429 and the unanswered rest of a group
    whose call failed run again; every line is done once; at most `concurrency` lines are in flight."""
    lines = [Line(i, f"c{i}", URL, {"model": "m" if i < 14 else "n", "prompt": f"p{i:02d}"}) for i in range(20)]
    in_flight, peak, tries, done, groups = 0, 0, {}, [], []

    async def send_group(group):
        nonlocal in_flight, peak
        groups.append([line.model for line in group])
        in_flight += len(group)
        peak = max(peak, in_flight)
        unanswered = len(group)
        try:
            for line in group:
                await asyncio.sleep(0.005)
                tries[line.custom_id] = tries.get(line.custom_id, 0) + 1
                if line.number == 3 and tries[line.custom_id] == 1:
                    raise Unavailable("replica restarting")  # c3 and the rest of its group: unanswered
                unanswered -= 1
                in_flight -= 1  # an answered line is out of flight
                if line.number == 4 and tries[line.custom_id] < 3:
                    yield line, Answer(429, {"error": {}}, "r")
                elif line.number == 5:
                    yield line, Answer(400, {"error": {"message": "bad"}}, "r")
                else:
                    yield line, Answer(200, {"usage": {"completion_tokens": 2}}, "r")
        finally:
            in_flight -= unanswered

    async def on_done(line, ok, result, tokens):
        done.append((line.custom_id, ok, result["response"]["status_code"], tokens))

    n = asyncio.run(run_lines(lines, send_group, on_done, 6, group_size=3, retry_s=0.001))
    assert n == 20 and peak == 6
    assert all(len(g) <= 3 and len(set(g)) == 1 for g in groups)  # one model a group
    assert sorted(c for c, *_ in done) == sorted(x.custom_id for x in lines)  # each once
    assert tries["c3"] == 2 and tries["c4"] == 3
    assert ("c5", False, 400, 0) in done and ("c0", True, 200, 2) in done

    done.clear()
    stop = []

    async def on_done_then_stop(line, ok, result, tokens):
        done.append(line.custom_id)
        if len(done) == 5:
            stop.append(True)

    n = asyncio.run(run_lines(lines, send_group, on_done_then_stop, 2, 1, lambda: bool(stop), retry_s=0.001))
    assert 5 <= n < 20 and len(done) == n


def test_a_groups_answered_lines_free_their_places_before_the_group_ends():
    """Each group's first line is slow: it is answered only once every other line has been (the tail of a group, as a
    long generation is). Places free line by line, so the fast lines of later groups run meanwhile, never more than
    `concurrency` at once; refilled group by group, the slow lines would hold every place and nothing would end."""
    lines = [Line(i, f"c{i}", URL, {"model": "m", "prompt": f"p{i:02d}"}) for i in range(12)]
    fast_left = asyncio.Event()
    answered, in_flight, peak = set(), 0, 0

    async def send_group(group):
        nonlocal in_flight, peak
        in_flight += len(group)
        peak = max(peak, in_flight)
        slow, *fast = group
        for line in fast:
            await asyncio.sleep(0)
            in_flight -= 1
            answered.add(line.number)
            if len(answered) == len(lines) - 4:  # all but the 4 groups' slow lines (groups of 3)
                fast_left.set()
            yield line, Answer(200, {"usage": {"completion_tokens": 1}}, "r")
        await fast_left.wait()
        in_flight -= 1
        yield slow, Answer(200, {"usage": {"completion_tokens": 1}}, "r")

    async def on_done(line, ok, result, tokens):
        pass

    n = asyncio.run(asyncio.wait_for(run_lines(lines, send_group, on_done, 6, group_size=3), 30))
    assert n == 12 and peak <= 6


async def _quiescent(rounds: int = 50) -> None:
    """Every task that can run has run until it waits (the loop turned `rounds` times; no clock involved)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_batch_share_takes_the_engine_when_idle_and_a_share_beside_online_requests():
    """No online request: batch lines are not bounded here; one running: at most `busy_lines`, the rest wait until a
    line ends; after the last online request the bound holds for `quiet_s` of the share's clock (a fake one here),
    then the waiting lines start. Fails if lines start during the quiet time (the clock is held still there) or never
    after it."""
    from deployments.batch.share import BatchShare

    async def scenario():
        now = [0.0]
        share = BatchShare(quiet_s=0.3, clock=lambda: now[0])
        share.busy_lines = 2
        held = [asyncio.Event() for _ in range(6)]
        started = []

        async def line(i):
            async with share.slot():
                started.append(i)
                await held[i].wait()

        share.online_started()
        tasks = [asyncio.create_task(line(i)) for i in range(4)]
        await until(lambda: len(started) == 2)
        await _quiescent()
        assert started == [0, 1] and share.running == 2  # the share, beside one online request
        held[0].set()
        await until(lambda: len(started) == 3)
        await _quiescent()
        assert started == [0, 1, 2]  # a line ended: the next one takes its place
        now[0] = 10.0
        share.online_ended()  # quiet time starts (the clock stands still): still the share
        await _quiescent()
        assert started == [0, 1, 2]
        now[0] = 10.31  # past the quiet time: the waiting lines start when they look again
        await until(lambda: len(started) == 4)
        assert started == [0, 1, 2, 3] and share.running == 3
        more = [asyncio.create_task(line(i)) for i in (4, 5)]
        await until(lambda: len(started) == 6)
        assert started == [0, 1, 2, 3, 4, 5]  # idle: no bound
        for e in held:
            e.set()
        await asyncio.gather(*tasks, *more)
        assert share.running == 0

    asyncio.run(scenario())


def test_online_requests_of_a_front_process_make_room_through_the_board():
    """A replica with a front process: idle, batch lines take the engine's sequences (idle_lines) and the rest wait
    here; an online request running in the front process (its own BatchShare, writing its slot of the replica's
    board) holds the replica's lines to the busy share until it ends. Without the board the replica would not see it
    and both waiting lines would start."""
    from deployments.batch.share import BatchShare, OnlineBoard

    async def settle():
        for _ in range(20):
            await asyncio.sleep(0)

    async def scenario(board: OnlineBoard):
        replica = BatchShare(quiet_s=0, idle_lines=3, board=board, slot=0)
        front = BatchShare(quiet_s=0, board=OnlineBoard(board.path, 2), slot=1)  # as the front process opens it
        replica.busy_lines = 1
        held = [asyncio.Event() for _ in range(5)]
        began = [asyncio.Event() for _ in range(5)]

        async def line(i):
            async with replica.slot():
                began[i].set()
                await held[i].wait()

        tasks = [asyncio.create_task(line(i)) for i in range(5)]
        await settle()
        assert [e.is_set() for e in began] == [True, True, True, False, False]  # the engine's sequences, no more
        front.online_started()
        for i in range(3):
            held[i].set()
        await settle()
        assert began[3].is_set() and not began[4].is_set() and replica.running == 1  # the busy share
        front.online_ended()
        await asyncio.wait_for(began[4].wait(), 10)  # the board says idle again: the waiting line starts
        for e in held:
            e.set()
        await asyncio.gather(*tasks)

    board = OnlineBoard.create(2)
    try:
        asyncio.run(scenario(board))
    finally:
        board.remove()


def test_http_routes_answer_openai_shapes_and_wake_the_runner(tmp_path):
    """The BatchAPI's own app (as its deployment builds it), in-process: no Ray, no HTTP server."""
    import httpx

    from deployments.batch.api import BatchAPI

    class Runner:  # the runner's handle: `wake.remote()` on each create and cancel
        wakes = 0

        @property
        def wake(self):
            return self

        def remote(self):
            Runner.wakes += 1

    api = BatchAPI(
        {"db_path": str(tmp_path / "db.sqlite3"), "files_path": str(tmp_path / "files"), "max_file_bytes": 1000},
        Runner(),
    )
    alice, bob = {"x-summit-owner": "alice"}, {"x-summit-owner": "bob"}

    async def calls():
        transport = httpx.ASGITransport(app=api._app)
        async with httpx.AsyncClient(transport=transport, base_url="http://batch") as c:
            up = await c.post(
                "/v1/files",
                headers=alice,
                data={"purpose": "batch"},
                files={"file": ("in.jsonl", jsonl(req("a")), "application/jsonl")},
            )
            assert up.status_code == 200 and up.json()["purpose"] == "batch"
            big = await c.post(
                "/v1/files", headers=alice, data={"purpose": "batch"}, files={"file": ("b", b"x" * 1001)}
            )
            assert big.status_code == 413 and big.json()["error"]["param"] == "file"
            create = {"input_file_id": up.json()["id"], "endpoint": URL, "completion_window": "24h"}
            batch = await c.post("/v1/batches", headers=alice, json=create)
            assert batch.status_code == 200 and batch.json()["status"] == "validating"
            bad = await c.post("/v1/batches", headers=alice, json={**create, "completion_window": "1w"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "completion_window"
            missing = await c.get(f"/v1/batches/{batch.json()['id']}", headers=bob)  # another key's batch
            assert missing.status_code == 404
            assert missing.json() == {
                "error": {
                    "message": f"No batch with id '{batch.json()['id']}'",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            }
            listed = await c.get("/v1/batches", headers=alice)
            assert [b["id"] for b in listed.json()["data"]] == [batch.json()["id"]]
            assert (await c.get("/v1/batches?limit=x")).json()["error"]["param"] == "limit"
            assert (await c.get("/v1/nope")).json()["error"]["code"] == 404
            assert (await c.post(f"/v1/batches/{batch.json()['id']}/cancel", headers=alice)).json()[
                "status"
            ] == "cancelling"

    asyncio.run(calls())
    assert Runner.wakes == 2
    api.store.close()


def test_summit_batch_starts_its_private_ray_again_when_the_node_misses_rays_startup_timeout(monkeypatch, capsys):
    """Ray gives a starting node a fixed 30 s to register (a loaded CI box missed it). Faked `ray.init`: the first
    try leaves a process of its temp dir and times out as Ray does; the second starts. That process is killed."""
    import subprocess
    import sys

    import ray

    from app.batch import offline

    tries, left = [], []

    def fake_init(**kwargs):
        tries.append(kwargs["_temp_dir"])
        if len(tries) == 1:
            left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", kwargs["_temp_dir"]]))
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    assert offline._start_ray(None, 2, {}) is True
    assert len(tries) == 2 and tries[0] != tries[1]
    assert left[0].wait(timeout=30) != 0  # killed
    assert "starting it again (1 of 3 tries)" in capsys.readouterr().err

    def always_late(**kwargs):
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", always_late)
    with pytest.raises(Exception, match="timed out during startup"):
        offline._start_ray(None, 2, {})


def test_a_rerun_takes_the_transient_errors_out_of_the_errors_file_and_keeps_a_4xx(tmp_path):
    """`summit batch` run again (a resubmitted SLURM job): lines that failed with a 5xx, 429 or no answer leave the
    errors file and run again; a 400 (the request's own fault) stays, and is skipped; `all` takes it too."""
    from app.batch.offline import finished_ids, retry_errors

    def line(cid: str, status: int | None) -> str:
        response = None if status is None else {"status_code": status, "request_id": "r", "body": {}}
        return json.dumps({"id": "b", "custom_id": cid, "response": response, "error": None}) + "\n"

    err = tmp_path / "out.errors.jsonl"
    err.write_text(line("a", 503) + line("b", 400) + line("c", 429) + line("d", None))
    assert retry_errors(err, "transient") == 3
    assert finished_ids(err) == {"b"}
    assert retry_errors(err, "none") == 0 and finished_ids(err) == {"b"}
    assert retry_errors(err, "all") == 1 and finished_ids(err) == set()
