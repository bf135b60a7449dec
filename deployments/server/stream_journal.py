"""Resumable streams (`models[].stream_resume`): each stream's events, kept where the stream is served, so that a client
whose connection dropped gets the events it missed, then the live rest, exactly once and in order.

A `Journal` is one stream. The engine call (server/engine_call.py) writes vLLM's bytes into it; the journal numbers
each event (an SSE `id:` line: http/stream_ids.py), keeps it, and hands it to the stream's one *reader*: the
connection that asked first, then whichever connection resumed it last (a resume takes the stream over; a dropped
connection that still writes gets nothing more). While no connection reads it the engine goes on; a stream nobody comes
back to within the window is aborted in the engine (`abort`). `StreamJournals` keeps one front process's journals:
an ended stream stays for the window, the oldest ended go first past the size cap, and what was dropped is
remembered (410, not 404). Plain asyncio: no Ray, no vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from deployments.http.errors import OpenAIError
from deployments.http.stream_ids import StreamPoint, event_id

Sink = Callable[[bytes, bool], Awaitable[None]]  # (numbered events, more to come) -> the reading client
_GONE_KEPT = 4096  # ids of dropped streams remembered, to answer 410 instead of 404


class Journal:
    """One stream's events as its clients get them (numbered), and who reads it now."""

    def __init__(self, stream_id: str, owner: bytes, store: StreamJournals):
        self.id, self.owner, self._store = stream_id, owner, store
        self.events: list[bytes] = []  # every event so far, each with its `id:` line (cleared if it is lost)
        self.count = 0  # events written
        self.size = 0  # bytes kept
        self.ended = False  # the engine's answer is complete
        self.lost: str | None = None  # why it can no longer be resumed
        self.abort = asyncio.Event()  # set when no client came back in time: the engine request is aborted
        self.sink: Sink | None = None  # the reading connection
        self.reader = 0  # which connection reads (each resume takes over)
        self.changed = asyncio.Event()  # a new reader, or the end
        self._partial = b""
        self._timer: asyncio.TimerHandle | None = None

    async def write(self, chunk: bytes, more: bool) -> None:
        """The engine's next bytes: kept as numbered events and passed to the reader (a reader that fails is dropped:
        its client left)."""
        *done, self._partial = (self._partial + chunk).split(b"\n\n")
        if not more and self._partial.strip():
            done.append(self._partial)
            self._partial = b""
        numbered = []
        for event in done:
            if event.strip():
                self.count += 1
                numbered.append(event_id(self.id, self.count) + event.lstrip(b"\n") + b"\n\n")
        data = b"".join(numbered)
        if self.lost is None:
            self.events.extend(numbered)
            self.size += len(data)
            self._store.grew(self, len(data))
        if not more:
            self.ended = True
            self._store.ended(self)
        sink = self.sink
        if sink is not None and (data or not more):
            try:
                await sink(data, more)
            except Exception:  # noqa: BLE001 — the reading client left: the stream waits for the next
                self.leave(sink)
        if not more:
            self.changed.set()

    async def read(self, sink: Sink) -> int:
        """`sink` reads the stream from now on; the connection that read it before gets the end of its body and
        nothing more. Returns this reader's number."""
        previous, self.sink, self.reader = self.sink, sink, self.reader + 1
        mine = self.reader
        self._stop_timer()
        self.changed.set()
        self.changed = asyncio.Event()
        if previous is not None and previous != sink:
            with contextlib.suppress(Exception):  # its client may be gone already
                await previous(b"", False)
        return mine

    def leave(self, sink: Sink) -> None:
        """The connection of `sink` went: if it was the reader, the stream waits for the next, at most the window."""
        if self.sink != sink:  # (a bound method is a new object each time; equal to itself)
            return
        self.sink = None
        if self.ended:
            return
        if self.lost is not None:  # nobody can take it up again: the engine request ends now
            self.abort.set()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._store.window_s, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.sink is None and not self.ended:
            self.lose(f"no client resumed it within stream_resume.window_s ({self._store.window_s:g} s)")
            self.abort.set()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            self._store.forget(self)
            self.events.clear()
            if self.sink is None and not self.ended:
                self.abort.set()

    def close(self) -> None:
        """The engine call ended without an end written (cancelled, failed): nobody waits for more."""
        self._stop_timer()
        if not self.ended:
            self.lose("the stream ended early")
            self.ended = True
            self._store.ended(self)
            self.changed.set()


class StreamJournals:
    """One front process's resumable streams: kept `window_s` after they end, at most `max_bytes` in all."""

    def __init__(self, window_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.max_bytes, self._clock = window_s, max_bytes, clock
        self.streams: OrderedDict[str, Journal] = OrderedDict()
        self._ended_at: dict[str, float] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # a dropped stream's id -> why
        self.bytes = 0

    def open(self, stream_id: str, owner: bytes) -> Journal:
        self._drop_expired()
        journal = Journal(stream_id, owner, self)
        self.streams[stream_id] = journal
        return journal

    def find(self, point: StreamPoint, owner: bytes) -> Journal:
        """The stream a resume names, for its owner: 404 if it was never here (or is another key's), 410 if it was
        dropped or can no longer be resumed, 400 if the client claims events the stream never had."""
        self._drop_expired()
        journal = self.streams.get(point.stream)
        if journal is not None and journal.owner != owner:
            journal = None  # never tell another key's stream exists
        if journal is None:
            why = self._gone.get(point.stream)
            if why is None:
                raise OpenAIError(
                    404, f"stream {point.stream!r} not found: it is not a stream of this key", param="Last-Event-ID"
                )
            raise OpenAIError(410, f"stream {point.stream!r} can no longer be resumed: {why}", param="Last-Event-ID")
        if journal.lost is not None:
            raise OpenAIError(
                410, f"stream {point.stream!r} can no longer be resumed: {journal.lost}", param="Last-Event-ID"
            )
        if point.seen > journal.count:
            raise OpenAIError(
                400,
                f"Last-Event-ID names event {point.seen} of stream {point.stream!r}, which has {journal.count} so far",
                param="Last-Event-ID",
            )
        return journal

    def grew(self, journal: Journal, added: int) -> None:
        """Past `max_bytes`: the oldest ended streams go; if that is not enough, this one can no longer be resumed."""
        self.bytes += added
        if self.bytes <= self.max_bytes:  # the common case, on every chunk: nothing to look through
            return
        for old in [j for j in self.streams.values() if j.ended and j is not journal]:
            if self.bytes <= self.max_bytes:
                break
            self._drop(old, "stream_resume.max_bytes: newer streams needed the room")
        if self.bytes > self.max_bytes:
            journal.lose(f"it outgrew stream_resume.max_bytes ({self.max_bytes} bytes of streams kept)")

    def ended(self, journal: Journal) -> None:
        self._ended_at[journal.id] = self._clock()

    def forget(self, journal: Journal) -> None:
        """A journal that can no longer be resumed frees its bytes at once (its id is remembered)."""
        self.bytes -= journal.size
        journal.size = 0

    def _drop(self, journal: Journal, why: str) -> None:
        self.streams.pop(journal.id, None)
        self._ended_at.pop(journal.id, None)
        self.forget(journal)
        journal.events.clear()
        self._gone[journal.id] = journal.lost or why
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)

    def _drop_expired(self) -> None:
        now = self._clock()
        for stream_id, at in list(self._ended_at.items()):
            if now - at >= self.window_s:
                self._drop(
                    self.streams[stream_id], f"it ended more than stream_resume.window_s ({self.window_s:g} s) ago"
                )


async def follow(journal: Journal, seen: int, sink: Sink, disconnected: Awaitable[None]) -> str:
    """A resumed connection: the events after the `seen` first, then the live rest, until the stream ends, another
    connection takes it over (then this one's body has ended) or this one's client leaves (`disconnected`
    completes). Returns which."""
    reader, sent = 0, seen
    gone = asyncio.ensure_future(disconnected)
    try:
        while reader == 0:
            if journal.lost is not None:  # dropped while this connection replayed it
                raise OpenAIError(410, f"stream {journal.id!r} can no longer be resumed: {journal.lost}")
            if sent < journal.count:
                batch = journal.events[sent : journal.count]
                sent = journal.count
                await sink(b"".join(batch), True)
                continue
            if journal.ended:  # every event sent: the end of the body
                await sink(b"", False)
                return "ended"
            reader = await journal.read(sink)  # caught up, nothing awaited since the check: the writer sends the rest
        while True:
            changed = asyncio.ensure_future(journal.changed.wait())
            await asyncio.wait({changed, gone}, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if journal.reader != reader:
                return "taken_over"
            if journal.ended:
                return "ended"
            if gone.done():
                journal.leave(sink)
                return "client_gone"
    finally:
        gone.cancel()
        journal.leave(sink)  # a no-op unless this connection still reads it
