"""Resumable streams' event ids: each names the front process that keeps the stream's events.

With `models[].stream_resume` on, every event of a streamed answer carries an SSE `id:` line,
`strm_<16 hex>-<model tag>-<front>-<replica>:<n>` (n counts the stream's events from 1), and the answer's
`x-summit-stream-id` header gives the part before the colon. A client whose connection dropped sends its request again
with `Last-Event-ID: <the last id it got>` (`<stream id>:0` for everything): every Summit hop can send that request to
the replica that keeps the stream (the two-hop ingress pins it there, as it pins a stored response; a replica that got
it anyway passes it on), and that replica's process `front` (0: the replica itself, 1..: its front processes) answers
it from the stream's journal (server/stream_journal.py).
"""

from __future__ import annotations

import re
import uuid
from typing import NamedTuple

from deployments.http.response_ids import model_tag

# the request header a resuming client sends (SSE's own), and the response header naming a resumable stream
LAST_EVENT_HEADER = b"last-event-id"
STREAM_HEADER = b"x-summit-stream-id"
_ID = re.compile(
    r"^(?P<stream>strm_[0-9a-f]{16}-(?P<tag>[0-9a-f]{8})-(?P<front>[0-9]{1,2})-(?P<replica>[A-Za-z0-9_.-]{1,64}))"
    r":(?P<seq>[0-9]{1,9})$"
)


class StreamPoint(NamedTuple):
    """Where a client resumes: the stream (its id, its model's tag, the replica and front process keeping it) and
    the number of events it already has."""

    stream: str
    tag: str
    front: int
    replica: str
    seen: int

    def model(self, names) -> str | None:
        """The model among `names` whose streams carry this tag."""
        return next((n for n in names if model_tag(n) == self.tag), None)


def new_stream_id(model: str, front: int, replica: str) -> str:
    return f"strm_{uuid.uuid4().hex[:16]}-{model_tag(model)}-{front}-{replica}"


def event_id(stream: str, seq: int) -> bytes:
    return b"id: %s:%d\n" % (stream.encode(), seq)


def resume_point(value: bytes | str | None) -> StreamPoint | None:
    """The point a `Last-Event-ID` value names, when it is one of Summit's event ids (None: no such header, or an id
    of somebody else's: the request is a new one)."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    found = _ID.match(value.strip()) if isinstance(value, str) else None
    if found is None:
        return None
    return StreamPoint(found["stream"], found["tag"], int(found["front"]), found["replica"], int(found["seq"]))
