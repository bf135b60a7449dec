"""Resumable streams' journal (deployments/server/stream_journal.py) and ids (deployments/http/stream_ids.py), without
an engine: events numbered and replayed exactly once in order, a resume taking a stream over, the window, the size
cap, and the 404/410/400 answers. The real-engine twins: tests/cpu/test_haproxy.py (direct path, keys),
tests/cpu/test_front_processes.py (front processes), tests/cpu/test_migration.py (the two-hop replica side)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.http.errors import OpenAIError
from deployments.http.stream_ids import event_id, new_stream_id, resume_point
from deployments.server.stream_journal import StreamJournals, follow


def chunk(i: int) -> bytes:
    return b'data: {"n":%d}\n\n' % i


def events_of(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e]


def numbers(data: bytes) -> list[int]:
    """The `id:` numbers of the events in `data`, in order."""
    return [int(e.split(b"\n", 1)[0].rsplit(b":", 1)[1]) for e in events_of(data)]


class Client:
    """A connection reading a stream: what it got, and whether its body ended."""

    def __init__(self):
        self.data, self.ended, self.left = b"", False, asyncio.Event()

    async def sink(self, data: bytes, more: bool) -> None:
        self.data += data
        self.ended = self.ended or not more

    async def gone(self) -> None:
        await self.left.wait()


def test_ids_name_the_stream_replica_and_front_and_round_trip():
    """Fails if an event id does not parse back to its stream, front, replica and number, or if a client's own id (or
    none) is taken for a resume."""
    stream = new_stream_id("tiny-llama", 2, "abc123.x")
    point = resume_point(event_id(stream, 17).removeprefix(b"id: ").strip())
    assert point is not None and (point.stream, point.front, point.replica, point.seen) == (stream, 2, "abc123.x", 17)
    assert point.model(["other", "tiny-llama"]) == "tiny-llama"
    assert resume_point(None) is None and resume_point(b"42") is None and resume_point(stream) is None  # no number


def test_a_resume_gets_the_missed_events_then_the_live_rest_exactly_once():
    """The first connection leaves after 3 of 10 events; the engine goes on (3 more written while nobody reads); a
    resume after event 3 gets 4..6 from the journal, then 7..10 live, then the end: with the first connection's, every
    event once, in order. Fails if the replay repeats or skips an event, or the live rest is not passed on."""

    async def run() -> None:
        journals = StreamJournals(window_s=30, max_bytes=1 << 20)
        first = Client()
        journal = journals.open(new_stream_id("m", 0, "r1"), b"key")
        await journal.read(first.sink)
        for i in range(1, 4):
            await journal.write(chunk(i), True)
        journal.leave(first.sink)
        for i in range(4, 7):
            await journal.write(chunk(i), True)
        point = resume_point(f"{journal.id}:3")
        again = Client()
        follower = asyncio.ensure_future(follow(journals.find(point, b"key"), point.seen, again.sink, again.gone()))
        while journal.sink is None:  # the follower caught up and reads live
            await asyncio.sleep(0)
        for i in range(7, 11):
            await journal.write(chunk(i), i < 10)
        assert await asyncio.wait_for(follower, 5) == "ended"
        assert numbers(first.data) == [1, 2, 3] and not first.ended
        assert numbers(again.data) == list(range(4, 11)) and again.ended
        assert [e.split(b"\n", 1)[1] for e in events_of(first.data + again.data)] == [
            chunk(i).strip() for i in range(1, 11)
        ]
        assert not journal.abort.is_set()

    asyncio.run(run())


def test_a_second_resume_takes_the_stream_over_and_a_resume_after_the_end_gets_the_rest():
    """Two resumes of one stream: the later takes it over (the earlier ends with nothing more), each gets what follows
    its own Last-Event-ID; a resume after the stream ended gets the rest and the end at once. Fails if both
    connections get the live events, the earlier one is left open, or a resume racing the end loses its last
    events."""

    async def run() -> None:
        journals = StreamJournals(window_s=30, max_bytes=1 << 20)
        journal = journals.open(new_stream_id("m", 0, "r1"), b"")
        for i in range(1, 6):
            await journal.write(chunk(i), True)
        one, two = Client(), Client()
        first = asyncio.ensure_future(follow(journal, 2, one.sink, one.gone()))
        while journal.sink is None:
            await asyncio.sleep(0)
        second = asyncio.ensure_future(follow(journal, 4, two.sink, two.gone()))
        assert await asyncio.wait_for(first, 5) == "taken_over"
        for i in range(6, 9):
            await journal.write(chunk(i), i < 8)
        assert await asyncio.wait_for(second, 5) == "ended"
        assert numbers(one.data) == [3, 4, 5] and one.ended  # its body ended when the later one took over
        assert numbers(two.data) == [5, 6, 7, 8] and two.ended
        late = Client()
        assert await follow(journals.find(resume_point(f"{journal.id}:6"), b""), 6, late.sink, late.gone()) == "ended"
        assert numbers(late.data) == [7, 8] and late.ended

    asyncio.run(run())


def test_nobody_back_within_the_window_aborts_the_request_and_later_resumes_are_410():
    """The reader leaves a live stream; nobody resumes it within the window: `abort` is set (the engine call then
    gives vLLM its http.disconnect) and a resume is answered 410. Fails if an abandoned stream runs on for ever, or
    is still offered."""

    async def run() -> None:
        journals = StreamJournals(window_s=0.05, max_bytes=1 << 20)
        journal = journals.open(new_stream_id("m", 0, "r1"), b"")
        reader = Client()
        await journal.read(reader.sink)
        await journal.write(chunk(1), True)
        journal.leave(reader.sink)
        await asyncio.wait_for(journal.abort.wait(), 10)
        with pytest.raises(OpenAIError) as e:
            journals.find(resume_point(f"{journal.id}:1"), b"")
        assert e.value.status == 410 and "window_s" in str(e.value)

    asyncio.run(run())


def test_answers_for_streams_that_are_gone_unknown_another_keys_or_ahead():
    """404 for an id never kept here and for another key's stream (never told apart), 410 for a stream dropped a window
    after its end, 400 for a Last-Event-ID past the stream's events. Fails if another key can read a stream."""

    async def run() -> None:
        now = [0.0]
        journals = StreamJournals(window_s=60, max_bytes=1 << 20, clock=lambda: now[0])
        journal = journals.open(new_stream_id("m", 0, "r1"), b"alice")
        await journal.write(chunk(1) + chunk(2), False)
        for point, owner, status in (
            (f"{new_stream_id('m', 0, 'r1')}:0", b"alice", 404),
            (f"{journal.id}:0", b"mallory", 404),
            (f"{journal.id}:3", b"alice", 400),
        ):
            with pytest.raises(OpenAIError) as e:
                journals.find(resume_point(point), owner)
            assert e.value.status == status, (point, owner)
        assert journals.find(resume_point(f"{journal.id}:0"), b"alice") is journal
        now[0] = 61.0
        with pytest.raises(OpenAIError) as e:
            journals.find(resume_point(f"{journal.id}:0"), b"alice")
        assert e.value.status == 410 and journals.bytes == 0

    asyncio.run(run())


def test_the_size_cap_drops_the_oldest_ended_stream_first_then_stops_keeping_a_live_one():
    """max_bytes: a new stream's events push out the oldest *ended* stream (410 for it), not a live one; a live stream
    that alone passes the cap can no longer be resumed, and with no reader its request is aborted at once. Fails if
    the store keeps more than its cap."""

    async def run() -> None:
        event = len(event_id(new_stream_id("m", 0, "r1"), 1)) + len(chunk(1))  # one numbered event's bytes
        journals = StreamJournals(window_s=60, max_bytes=event * 6)
        old = journals.open(new_stream_id("m", 0, "r1"), b"")
        await journal_write(old, 3, end=True)
        live = journals.open(new_stream_id("m", 0, "r1"), b"")
        await journal_write(live, 4)
        assert journals.bytes <= journals.max_bytes and old.id not in journals.streams
        with pytest.raises(OpenAIError) as e:
            journals.find(resume_point(f"{old.id}:0"), b"")
        assert e.value.status == 410
        await journal_write(live, 3)  # 7 events: more than the cap alone
        assert live.lost and journals.bytes == 0 and live.abort.is_set()
        with pytest.raises(OpenAIError) as e:
            journals.find(resume_point(f"{live.id}:0"), b"")
        assert e.value.status == 410 and "max_bytes" in str(e.value)

    asyncio.run(run())


async def journal_write(journal, n: int, end: bool = False) -> None:
    for i in range(n):
        await journal.write(chunk(journal.count + 1), not (end and i == n - 1))


class FakeStreamingEngineApp:
    """A fake engine app (standing in for vLLM's OpenAI app): an SSE stream of `n` events, each sent once the test
    lets it (`allow`); `aborted` is set when it reads http.disconnect (vLLM then aborts the engine request)."""

    def __init__(self, n: int):
        self.n, self.allowed, self.sent = n, asyncio.Semaphore(0), 0
        self.aborted, self.finished = asyncio.Event(), asyncio.Event()

    def allow(self, k: int) -> None:
        for _ in range(k):
            self.allowed.release()

    async def __call__(self, scope, receive, send):
        await receive()  # the body
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        stream = asyncio.ensure_future(self._stream(send))

        async def listen() -> None:  # as Starlette's StreamingResponse: a disconnect cancels the stream
            if (await receive())["type"] == "http.disconnect":
                self.aborted.set()
                stream.cancel()

        listener = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({stream})
        finally:
            listener.cancel()

    async def _stream(self, send) -> None:
        for i in range(1, self.n + 1):
            await self.allowed.acquire()
            await send({"type": "http.response.body", "body": chunk(i), "more_body": True})
            self.sent = i
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        self.finished.set()


def streaming_front(resume: bool):
    from deployments.pipeline.admission import Admission
    from deployments.server.front import EngineSide, FrontOptions, ReplicaFront
    from deployments.server.models import ModelTable

    engine = FakeStreamingEngineApp(8)
    options = FrontOptions(admission=Admission(4, 4, 503, 1))
    if resume:
        options.journals = StreamJournals(window_s=60, max_bytes=1 << 20)
    return ReplicaFront(EngineSide(engine, lambda: False, "replica-1"), ModelTable("a", ["a"]), options), engine


class Connection:
    """One client connection to the front: what it got; `drop()` closes it as a client that goes away does (the
    server's receive says http.disconnect and, on the direct path, Serve cancels the request's task)."""

    def __init__(self, front, headers=(), body=b'{"model": "a", "stream": true}'):
        self.messages: list[dict] = []
        self.got = asyncio.Event()
        self._left = asyncio.Event()
        self._request = [{"type": "http.request", "body": body, "more_body": False}]
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers)}
        self.task = asyncio.ensure_future(front({**scope, "query_string": b""}, self._receive, self._send))

    async def _receive(self):
        if self._request:
            return self._request.pop(0)
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message):
        if self._left.is_set():
            raise OSError("the client left")
        self.messages.append(message)
        self.got.set()

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    def header(self, name: bytes) -> bytes | None:
        start = next(m for m in self.messages if m["type"] == "http.response.start")
        return dict(start["headers"]).get(name)

    async def events(self, n: int) -> None:
        while len(events_of(self.body)) < n:
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), 10)

    async def has_events(self, n: int, timeout_s: float = 10) -> bool:
        """Whether `n` events arrive within `timeout_s` (False, for the caller's assertion, when they do not)."""
        try:
            await asyncio.wait_for(self.events(n), timeout_s)
        except TimeoutError:
            return False
        return True

    async def drop(self) -> None:
        self._left.set()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.mark.parametrize("resume", [True, False])
def test_a_client_that_leaves_a_resumable_stream_leaves_its_request_running_for_the_resume(resume):
    """Through the front (a fake engine app): the client gets 3 events and leaves (disconnect + its task cancelled).
    With stream_resume the engine is not told (no abort), the request keeps its admission slot while the engine goes
    on, and a request sent again with `Last-Event-ID` gets events 4.. and [DONE] — with the first connection's, the
    whole stream once; the slot is freed at the end. Without it (the control) the engine app reads http.disconnect
    and aborts. Fails if a resumable stream's request is aborted or freed when its client leaves."""
    from deployments.http.stream_ids import STREAM_HEADER

    async def run() -> None:
        front, engine = streaming_front(resume)
        first = Connection(front)
        engine.allow(3)
        await first.events(3)
        await first.drop()
        if not resume:
            await asyncio.wait_for(engine.aborted.wait(), 10)
            assert engine.sent == 3 and first.header(STREAM_HEADER) is None
            return
        assert front.options.admission._running == 1 and len(front.detached) == 1  # the request goes on
        engine.allow(2)  # two more events while nobody reads
        stream = first.header(STREAM_HEADER).decode()
        last = events_of(first.body)[-1].split(b"\n", 1)[0].removeprefix(b"id: ")
        again = Connection(front, [(b"last-event-id", last)], body=b"")
        # the two it missed, from the journal (a resume taken for a new request would wait for the engine instead)
        assert await again.has_events(2), f"the resume got {again.body!r}, not the two events it missed"
        engine.allow(100)
        await asyncio.wait_for(again.task, 10)
        await asyncio.wait_for(engine.finished.wait(), 10)
        assert not engine.aborted.is_set() and again.header(STREAM_HEADER).decode() == stream
        assert numbers(first.body) == [1, 2, 3] and numbers(again.body) == list(range(4, 10))  # 8 events + [DONE]
        whole = [e.split(b"\n", 1)[1] for e in events_of(first.body + again.body)]
        assert whole == [chunk(i).strip() for i in range(1, 9)] + [b"data: [DONE]"]
        while front.detached:  # the detached request's task ends with the engine's stream
            await asyncio.wait(set(front.detached))
        assert front.options.admission._running == 0

    asyncio.run(run())


def test_a_resume_reaching_another_replica_or_process_goes_on_to_the_one_keeping_the_stream():
    """The front (fake engine app) gets resumes of streams it does not keep: one of another replica goes on through the
    deployment's handle pinned to that replica (x-summit-target-replica, marked forwarded, with the caller's owner);
    one of its own replica's front process goes to that process (`siblings`); one already passed on once is 410, not
    passed on again. Fails if a resume is answered where it landed (404: this process keeps no such stream)."""
    from deployments.http.protocol import ResponseStart
    from tests.unit.test_front import FakeReplicaStream

    sent, asked = [], []

    def to_keeper(request):
        sent.append(request)
        return FakeReplicaStream([ResponseStart(200, [(b"content-type", b"text/event-stream")]), b"data: kept\n\n"])

    def siblings(front, point, caller):
        asked.append((front, point.stream, caller))
        return FakeReplicaStream([ResponseStart(200, []), b"data: sibling\n\n"])

    async def run() -> None:
        front, _ = streaming_front(True)
        front.options.to_keeper, front.options.siblings = to_keeper, siblings
        elsewhere = new_stream_id("a", 0, "replica-2")
        there = Connection(front, [(b"last-event-id", f"{elsewhere}:4".encode())], body=b"")
        await asyncio.wait_for(there.task, 10)
        assert len(sent) == 1, f"the resume should go on to the replica keeping the stream; sent on: {sent}"
        (request,) = sent
        assert request.header(b"x-summit-target-replica") == b"replica-2" and request.header(b"x-summit-forwarded")
        assert request.header(b"last-event-id") == f"{elsewhere}:4".encode() and b"data: kept" in there.body
        own_front = new_stream_id("a", 1, "replica-1")
        sibling = Connection(front, [(b"last-event-id", f"{own_front}:0".encode())], body=b"")
        await asyncio.wait_for(sibling.task, 10)
        assert asked == [(1, own_front, b"")] and b"data: sibling" in sibling.body
        again = Connection(front, [(b"last-event-id", f"{elsewhere}:4".encode()), (b"x-summit-forwarded", b"1")])
        await asyncio.wait_for(again.task, 10)
        start = next(m for m in again.messages if m["type"] == "http.response.start")
        assert start["status"] == 410 and len(sent) == 1

    asyncio.run(run())
