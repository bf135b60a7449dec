"""Fuzz Summit's HTTP entry: schemathesis cases from Summit's own OpenAPI document (`GET /openapi.json`: vLLM's
request schemas for the OpenAI routes, Summit's for /v1/files and /v1/batches), valid and invalid, for every
operation, plus hand cases schemas do not reach (content types, non-UTF-8, huge and deeply nested bodies, wrong
methods, unknown paths, header floods).

    python bench/fuzz.py --requests 10000 [--json out.json]    # the shipped tiny app on a private loopback cluster
    python bench/fuzz.py --base-url http://127.0.0.1:8000 --requests 10000 [--api-key KEY]    # a running Summit

Every answer is checked: no status >= 500 unless an honest 503 with Retry-After; every 4xx/5xx body OpenAI-shaped
({"error": {"message", "type", "code"}}); nothing in any error that tells an attacker about the host (a traceback, a
file path, an IP address, a pid, a Ray actor or replica id); no request left without an answer (hung). Afterwards
the app must still answer a completion. Generation is kept small (max_tokens <= 8, n <= 2) so that 10,000 requests
take minutes on a tiny CPU model. Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMEOUT_S = 120.0  # an answer later than this is "hung"
# What must never appear in an error answer: a Python traceback or source location, a file-system path, an IPv4
# address, a pid, Ray's actor / replica / node ids.
LEAKS = re.compile(
    r"Traceback \(most recent|File \"[^\"]+\", line|/(?:home|tmp|usr|opt|root|work|proc)/|"
    r"site-packages|\b(?:\d{1,3}\.){3}\d{1,3}\b|\bpid\b|\bActor(?:ID|Id)?\b|ReplicaID|"
    r"\b(?=[0-9]*[a-f])[0-9a-f]{32,56}\b|ray::|SERVE_REPLICA",
    re.I,
)
# Requests HAProxy refuses in its HTTP parser, before any of its rules or errorfiles apply (HAProxy 2.8, as Serve
# bundles it): its own HTML 400. The one answer of Summit's entry that is not OpenAI-shaped
# (docs/operations/security.md).
HAPROXY_PARSER_400 = frozenset({"long path (16 KiB)", "header flood (300 headers)", "one 64 KiB header"})
GENERATION_CAPS = {
    "max_tokens": 8,
    "max_completion_tokens": 8,
    "n": 2,
    "best_of": 2,
    "min_tokens": 4,
    "logprobs": 5,
    "top_logprobs": 5,
    "prompt_logprobs": 5,
}


ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error(body: bytes) -> bool:
    """Anthropic's error shape: {"type": "error", "error": {"type": ..., "message": ...}}."""
    try:
        answer = json.loads(body)
        return answer["type"] == "error" and all(isinstance(answer["error"][k], str) for k in ("type", "message"))
    except Exception:  # noqa: BLE001
        return False


def problem(status: int, headers, body: bytes, sent: str = "", path: str = "") -> str | None:
    """What is wrong with one answer, or None. `sent`: what the client sent (URL, query, body): an answer may echo
    the client's own input (`?after=ReplicaId` answered "no object with id 'ReplicaId'") without leaking. `path`: on
    Anthropic's routes (/v1/messages...) vLLM answers errors in Anthropic's shape, which their clients read."""
    if status >= 500 and not (status == 503 and "retry-after" in {k.lower() for k in headers.keys()}):
        return f"server error {status}"
    if status >= 400:
        try:
            error = json.loads(body)["error"]
            ok = isinstance(error["message"], str) and isinstance(error["type"], str) and error["code"] == status
        except Exception:  # noqa: BLE001 — anything not OpenAI's shape
            ok = path.startswith(ANTHROPIC_PREFIX) and anthropic_error(body)
        if not ok:
            return f"{status} not OpenAI-shaped"
        text = body.decode("utf-8", "replace")
        for leak in LEAKS.finditer(text):
            if leak.group(0).lower() not in sent.lower():
                return f"{status} leaks {leak.group(0)!r}"
    return None


@dataclass
class Report:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)
    hung: int = 0
    seconds: float = 0.0
    healthy_after: bool | None = None

    def add(self, label: str, status: int | None, why: str | None, sample: str = "", sent: bytes = b"") -> None:
        self.requests += 1
        self.by_operation[label] += 1
        self.statuses[str(status) if status is not None else "no answer"] += 1
        if why:
            if len(self.failures) < 200:
                self.failures.append(
                    {
                        "operation": label,
                        "problem": why,
                        "sample": sample[:400],
                        "sent": sent[:400].decode("utf-8", "replace"),
                    }
                )
            self.hung += status is None

    def as_json(self) -> dict:
        return {
            "requests": self.requests,
            "statuses": dict(self.statuses),
            "by_operation": dict(self.by_operation),
            "failures": len(self.failures),
            "failure_samples": self.failures[:50],
            "hung": self.hung,
            "seconds": round(self.seconds, 1),
            "healthy_after": self.healthy_after,
        }


def _small(body, model: str, rng: random.Random):
    """A generated body kept cheap to serve: the served model most of the time, generation lengths capped."""
    if not isinstance(body, dict):
        return body
    if rng.random() < 0.85:
        body["model"] = model
    for key, cap in GENERATION_CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if "messages" in body or "prompt" in body:
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 4
    return body


def fuzz_schema(base_url: str, requests: int, seed: int, api_key: str | None, model: str, report: Report) -> None:
    """`requests` cases from /openapi.json, valid then invalid ones, the same number for each operation."""
    import schemathesis
    from schemathesis import GenerationMode

    doc = httpx.get(base_url + "/openapi.json", timeout=60).json()
    operations = [r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations()]
    rng = random.Random(seed)
    session = httpx.Client(base_url=base_url, timeout=TIMEOUT_S)
    runs = [(op, mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) for op in operations]
    done = 0
    while done < requests and runs:  # rounds: what is left, spread evenly over the (operation, mode) that still draw
        alive = []
        for i, (op, mode) in enumerate(runs):
            quota = (requests - done + len(runs) - i - 1) // (len(runs) - i)
            sent = _draw(
                op,
                mode,
                quota,
                rng.randrange(1 << 30),
                lambda case, op=op: _send_case(session, case, op, api_key, model, rng, report),
            )
            done += sent
            if sent == quota:  # an operation with few distinct cases (GET /health) is left out of the next round
                alive.append((op, mode))
        runs = alive


def _draw(op, mode, quota: int, seed: int, send) -> int:
    """Send up to `quota` cases of one operation in one generation mode, seeded; how many were sent."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed
    from hypothesis.errors import Unsatisfiable

    sent = 0

    def one(case):
        nonlocal sent
        if sent < quota:  # hypothesis may draw a few more than max_examples
            sent += 1
            send(case)

    test = settings(
        max_examples=max(quota, 1),
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )(given(op.as_strategy(generation_mode=mode))(one))
    try:
        with_seed(seed)(test)()
    except Unsatisfiable:  # no case of this mode (an invalid GET /health)
        pass
    return sent


def _send_case(session: httpx.Client, case, op, api_key, model, rng, report: Report) -> None:
    headers = {k: str(v) for k, v in (case.headers or {}).items()}
    if api_key and rng.random() < 0.9:
        headers["Authorization"] = f"Bearer {api_key}"
    path = case.formatted_path
    kwargs: dict = {"params": case.query or None}
    body = case.body
    if case.media_type == "multipart/form-data" and isinstance(body, dict):
        kwargs["files"] = {k: (k, v if isinstance(v, bytes) else str(v).encode()) for k, v in body.items()}
    elif isinstance(body, (bytes, bytearray)):
        kwargs["content"] = bytes(body)
        headers.setdefault("content-type", case.media_type or "application/json")
    elif not _is_unset(body):
        kwargs["content"] = json.dumps(_small(body, model, rng)).encode()
        headers.setdefault("content-type", case.media_type or "application/json")
    label = f"{op.method.upper()} {op.path}"
    try:
        with session.stream(op.method.upper(), path, headers=headers, **kwargs) as r:
            data = r.read()
            sent = kwargs.get("content") or repr(kwargs.get("files")).encode()
            echo = f"{r.request.url} {sent.decode('utf-8', 'replace')}"
            report.add(
                label,
                r.status_code,
                problem(r.status_code, r.headers, data, echo, op.path),
                data.decode("utf-8", "replace"),
                sent,
            )
    except httpx.TimeoutException:
        report.add(label, None, "hung", str(kwargs.get("content", b""))[:400])
    except httpx.HTTPError as e:
        report.add(label, None, f"connection: {e!r}", str(kwargs.get("content", b""))[:400])


def _is_unset(value) -> bool:
    return value is None or type(value).__name__ == "NotSet"


def hand_cases(model: str) -> list[tuple[str, str, str, dict, bytes]]:
    """(name, method, path, headers, body) for what schemas do not generate."""
    good = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    chat = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    nested = b'{"model": "%s", "prompt": ' % model.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}"
    json_h = {"content-type": "application/json"}
    return [
        ("text/plain body", "POST", "/v1/completions", {"content-type": "text/plain"}, good),
        (
            "multipart body",
            "POST",
            "/v1/chat/completions",
            {"content-type": "multipart/form-data; boundary=x"},
            b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + model.encode() + b"\r\n--x--\r\n",
        ),
        ("no content type", "POST", "/v1/completions", {}, good),
        ("non-UTF-8 body", "POST", "/v1/chat/completions", json_h, b'{"model": "\xff\xfe", "messages": []}'),
        ("non-UTF-8 prompt", "POST", "/v1/completions", json_h, good.replace(b'"hi"', b'"h\xc3\x28i"')),
        (
            "latin-1 content type",
            "POST",
            "/v1/completions",
            {"content-type": "application/json; charset=latin-1"},
            good,
        ),
        (
            "huge body (64 MiB, over the 32 MiB limit)",
            "POST",
            "/v1/completions",
            json_h,
            b'{"model": "%s", "prompt": "' % model.encode() + b"a " * (32 << 20) + b'"}',
        ),
        ("deeply nested JSON", "POST", "/v1/completions", json_h, nested),
        (
            "deeply nested chat",
            "POST",
            "/v1/chat/completions",
            json_h,
            b'{"model": "%s", "messages": ' % model.encode() + b"[" * 50_000 + b"]" * 50_000 + b"}",
        ),
        (
            "messages null",
            "POST",
            "/v1/chat/completions",
            json_h,
            json.dumps({"model": model, "messages": None}).encode(),
        ),
        ("prompt null", "POST", "/v1/completions", json_h, json.dumps({"model": model, "prompt": None}).encode()),
        ("JSON array body", "POST", "/v1/completions", json_h, b"[1, 2, 3]"),
        ("empty body", "POST", "/v1/chat/completions", json_h, b""),
        (
            "NaN and huge numbers",
            "POST",
            "/v1/completions",
            json_h,
            b'{"model": "%s", "prompt": "x", "temperature": NaN, "max_tokens": 1e999}' % model.encode(),
        ),
        (
            "duplicate keys",
            "POST",
            "/v1/completions",
            json_h,
            b'{"model": "nope", "model": "%s", "prompt": "x", "max_tokens": 1}' % model.encode(),
        ),
        ("GET a POST route", "GET", "/v1/completions", {}, b""),
        ("PUT /v1/models", "PUT", "/v1/models", json_h, b"{}"),
        ("DELETE a POST route", "DELETE", "/v1/chat/completions", {}, b""),
        ("unknown path", "GET", "/v2/engines", {}, b""),
        ("vLLM-only path", "GET", "/metrics", {}, b""),
        ("vLLM-only POST", "POST", "/v1/responses", json_h, chat),
        ("dot-dot path", "GET", "/v1/files/..%2F..%2Fetc%2Fpasswd/content", {}, b""),
        ("long path (16 KiB)", "GET", "/v1/" + "a" * (16 << 10), {}, b""),
        (
            "header flood (300 headers)",
            "POST",
            "/v1/completions",
            {**json_h, **{f"x-h{i}": "v" * 100 for i in range(300)}},
            good,
        ),
        ("one 64 KiB header", "POST", "/v1/completions", {**json_h, "x-big": "v" * (64 << 10)}, good),
        (
            "bad bearer",
            "POST",
            "/v1/chat/completions",
            {**json_h, "authorization": "Bearer \u00ff".encode("latin-1")},
            chat,
        ),
        ("bogus traceparent", "POST", "/v1/completions", {**json_h, "traceparent": "00-zz-yy-01"}, good),
        (
            "stream with n",
            "POST",
            "/v1/chat/completions",
            json_h,
            json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "n": 2,
                    "stream": True,
                }
            ).encode(),
        ),
    ]


# /v1/responses input items of every type with null, empty and mismatched fields (vLLM's own server answered some
# such bodies 500 with an empty message): each must be a 4xx
_RESPONSE_ITEMS = {
    "function_call_output": [
        {"type": "function_call_output"},
        {"type": "function_call_output", "call_id": None, "output": None},
        {"type": "function_call_output", "call_id": "", "output": ""},
        {"type": "function_call_output", "call_id": 7, "output": {"not": "a string"}},
    ],
    "function_call": [
        {"type": "function_call", "call_id": None, "name": None, "arguments": None},
        {"type": "function_call", "call_id": "c", "name": "", "arguments": "{not json"},
    ],
    "input_file": [
        {"type": "message", "role": "user", "content": [{"type": "input_file"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": None, "file_data": None}]},
        {"type": "message", "role": "user", "content": [{"type": "input_file", "file_data": "", "filename": ""}]},
        {"type": "message", "role": "user", "content": [{"type": "input_file", "file_url": 12}]},
    ],
    "input_image": [
        {"type": "message", "role": "user", "content": [{"type": "input_image"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": None}]},
        {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": ""}]},
        {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "not a url"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_image", "file_id": 3, "detail": "huge"}]},
    ],
    "reasoning": [
        {"type": "reasoning"},
        {"type": "reasoning", "id": None, "summary": None},
        {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": None}]},
        {"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text", "text": 5}]},
    ],
    "message": [
        {"role": "user", "content": None},
        {"role": "user", "content": []},
        {"role": None, "content": "hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": None}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text"}]},
        {"type": "message", "role": "user", "content": [{"type": None, "text": "hi"}]},
    ],
    "other": [{}, {"type": None}, {"type": "no_such_item"}, None, "a string item", 5],
}


def responses_item_cases(model: str) -> list[tuple[str, str, str, dict, bytes]]:
    """Hand cases: `/v1/responses` bodies whose `input` holds one bad item of each type (after a good message)."""
    json_h = {"content-type": "application/json"}
    cases = []
    for kind, items in _RESPONSE_ITEMS.items():
        for i, item in enumerate(items):
            body = {"model": model, "max_output_tokens": 2, "input": [{"role": "user", "content": "hi"}, item]}
            cases.append((f"responses input: {kind} {i}", "POST", "/v1/responses", json_h, json.dumps(body).encode()))
    return cases


def pooling_cases(model: str) -> list[tuple[str, str, str, dict, bytes]]:
    """Hand cases for the pooling routes (an embedding or classification model's app): null, empty and mismatched
    inputs."""
    json_h = {"content-type": "application/json"}
    bodies = {
        "/v1/embeddings": [
            {"input": None},
            {"input": []},
            {"input": [[]]},
            {"input": [None]},
            {"input": ["a", 1]},
            {"input": [[1, "a"]]},
            {"input": "x", "encoding_format": "hex"},
            {"input": "x", "dimensions": -1},
            {"input": [-5, 10**12]},
            {"messages": None},
            {"messages": [{"role": "user", "content": None}]},
        ],
        "/pooling": [{"input": None}, {"input": []}, {"input": [None]}, {"messages": []}],
        "/classify": [{"input": None}, {"input": []}, {"input": [{}]}],
        "/score": [
            {"text_1": None, "text_2": None},
            {"text_1": [], "text_2": []},
            {"text_1": "a", "text_2": [None]},
            {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
        ],
        "/rerank": [
            {"query": None, "documents": None},
            {"query": "q", "documents": []},
            {"query": "q", "documents": [None]},
            {"query": "q", "documents": ["d"], "top_n": -1},
        ],
    }
    return [
        (f"{path} {i}", "POST", path, json_h, json.dumps({"model": model, **body}).encode())
        for path, cases in bodies.items()
        for i, body in enumerate(cases)
    ]


def run_hand_cases(
    base_url: str, model: str, api_key: str | None, report: Report, cases: list | None = None
) -> list[dict]:
    """Each case sent once; its answer judged (`problem`). `cases`: these instead of the generic ones plus the
    /v1/responses input items."""
    outcomes = []
    cases = cases if cases is not None else hand_cases(model) + responses_item_cases(model)
    with httpx.Client(base_url=base_url, timeout=TIMEOUT_S) as session:
        for name, method, path, headers, body in cases:
            if api_key:
                headers = {"authorization": f"Bearer {api_key}", **headers}
            try:
                r = session.request(method, path, headers=headers, content=body or None)
                why = problem(r.status_code, r.headers, r.content)
                if name in HAPROXY_PARSER_400 and r.status_code == 400 and r.content.startswith(b"<html>"):
                    why = None  # HAProxy's parser answered (documented), not Summit
                report.add(f"hand: {name}", r.status_code, why, r.text)
                outcomes.append({"case": name, "status": r.status_code, "problem": why, "answer": r.text[:160]})
            except httpx.TimeoutException:
                report.add(f"hand: {name}", None, "hung")
                outcomes.append({"case": name, "status": None, "problem": "hung"})
            except httpx.HTTPError as e:  # a connection the server closed without an answer
                report.add(f"hand: {name}", None, f"connection: {e!r}")
                outcomes.append({"case": name, "status": None, "problem": f"connection: {e!r}"})
    return outcomes


def still_serving(base_url: str, model: str, api_key: str | None) -> bool:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(
        base_url + "/v1/completions",
        headers=headers,
        timeout=60,
        json={"model": model, "prompt": "ok", "max_tokens": 2, "ignore_eos": True},
    )
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def fuzz(base_url: str, requests: int, seed: int = 0, api_key: str | None = None) -> tuple[Report, list[dict]]:
    """`requests` schema cases (positive and negative, spread over every operation) and the hand cases."""
    model = served_model(base_url, api_key)
    report, start = Report(), time.monotonic()
    outcomes = run_hand_cases(base_url, model, api_key, report)
    fuzz_schema(base_url, requests, seed, api_key, model, report)
    report.seconds = time.monotonic() - start
    report.healthy_after = still_serving(base_url, model, api_key)
    return report, outcomes


def private_app():
    """The shipped tiny app (serve_configs/tiny-cpu.yaml, Batch API on) behind HAProxy on a private loopback cluster
    (tests/cpu/engine_apps.deployed, as overload.py starts its app)."""
    import tempfile

    from app.clusters.tiny_model import make_tiny_model
    from tests.cpu.engine_apps import deployed
    from tests.local_cluster import load_serve_config

    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="summit-fuzz-")) / "tiny-llama", max_len=2048)
    shipped = load_serve_config(Path(__file__).resolve().parents[1] / "serve_configs/tiny-cpu.yaml")
    return deployed(shipped["applications"][0]["args"]["models"], model_dir, haproxy=True, batch=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running Summit (default: start the shipped tiny app privately)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    if args.base_url is None:
        with private_app() as cluster:
            report, outcomes = fuzz(cluster.base_url, args.requests, args.seed, args.api_key)
    else:
        report, outcomes = fuzz(args.base_url, args.requests, args.seed, args.api_key)
    summary = {**report.as_json(), "hand_cases": outcomes}
    print(json.dumps({k: v for k, v in summary.items() if k != "failure_samples"}, indent=1))
    for failure in report.failures[:20]:
        print("FAIL", failure)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 1 if report.failures or not report.healthy_after else 0


if __name__ == "__main__":
    sys.exit(main())
