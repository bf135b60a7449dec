"""The request/response contract between the HTTP entries, the routers and a model replica (plain data, no Ray, no
vLLM), and the headers Summit's own hops carry."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

REQUEST_ID_HEADER = b"x-request-id"
# A replica a request must not go to (a resumed stream's continuation names the replica whose engine died); Summit's
# routers skip it.
AVOID_HEADER = b"x-summit-avoid-replica"
# The replica a request must go to (the one keeping the stored response it names: http/response_ids.py); Summit's
# routers send it there while that replica lives.
TARGET_HEADER = b"x-summit-target-replica"
# Who owns a file or batch (a hash of the caller's API key), as the HTTP entry tells the BatchAPI; a client's own is
# dropped.
OWNER_HEADER = b"x-summit-owner"
# A request another replica handed on (never handed on twice: no loops).
FORWARDED_HEADER = b"x-summit-forwarded"
# The replica that answered (the engine's), on every generation answer.
REPLICA_HEADER = b"x-summit-replica"
# When the request arrived at the first Summit process it met (epoch seconds), set by the two-hop ingress and by a
# replica that hands a request to another model's replica; trusted only on requests that came through a Serve handle.
ARRIVAL_HEADER = b"x-summit-arrival"
# The request path and why, on the two-hop ingress's /v1/models answer (`summit wait-ready` reads it).
PATH_HEADER = b"x-summit-request-path"
# Set in the ASGI scope of a request that came through a Serve handle, not from a client (let in where it entered).
INTERNAL_SCOPE_KEY = "summit.internal"
# Set (with it) in the ASGI scope of a batch line: it is not online traffic (deployments/batch/share.py).
BATCH_LINE_SCOPE_KEY = "summit.batch_line"
# The Batch API's routes (/v1/files..., /v1/batches...): served by the BatchAPI deployment.
BATCH_PREFIXES = ("/v1/files", "/v1/batches")
# What never goes on to an engine or another deployment: the API key stops at the entry; hop headers are each hop's.
HOP_HEADERS = frozenset(
    {
        b"authorization",
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        REQUEST_ID_HEADER,
        FORWARDED_HEADER,
        OWNER_HEADER,
        ARRIVAL_HEADER,
        TARGET_HEADER,
    }
)


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header `name` (lower case) in ASGI-style headers."""
    return next((v for k, v in headers if k.lower() == name), None)


def without(headers: Iterable[tuple[bytes, bytes]], names: Iterable[bytes]) -> list[tuple[bytes, bytes]]:
    drop = frozenset(names)
    return [(k, v) for k, v in headers if k.lower() not in drop]


@dataclass
class HTTPRequest:
    """What the ingress forwards to a model replica: enough to rebuild the ASGI scope."""

    method: str
    path: str
    body: bytes = b""
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    # The model the body names, when the sender has read it (the direct path's route picker): routers keep to it.
    model: str | None = None

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        found = header(self.headers, name)
        return default if found is None else found

    def set_header(self, name: bytes, value: bytes) -> None:
        """Replace every `name` header (a client's too) with one."""
        self.headers = [(k, v) for k, v in self.headers if k.lower() != name] + [(name, value)]

    def scope(self) -> dict:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": self.query_string,
            "headers": self.headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 80),
            "state": {},
        }


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        found = header(self.headers, name)
        return default if found is None else found
