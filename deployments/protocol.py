"""The request/response contract between the ingress, the routers and a model replica (plain data, no Ray, no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field


# A replica a request must not go to (a resumed stream's continuation names the replica whose engine died); Summit's
# routers skip it.
AVOID_HEADER = b"x-summit-avoid-replica"


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
        return next((v for k, v in self.headers if k.lower() == name), default)

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
        return next((v for k, v in self.headers if k.lower() == name), default)
