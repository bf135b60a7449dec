"""A batch's input lines and result lines, as OpenAI defines them (pure: no Ray, no vLLM).

Input, one JSON object a line: `{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}`. Output line: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}` (a 2xx in the output file, any other status in the error file); a line that never ran (its
batch expired or was cancelled first) has `"response": null, "error": {"code": "batch_expired" | "batch_cancelled",
"message"}` in the error file. Every input `custom_id` appears exactly once across the two files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from deployments.batch.store import new_id

URLS = ("/v1/chat/completions", "/v1/completions")
_WINDOW = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass
class Line:
    number: int  # 1-based, as an editor shows it
    custom_id: str
    url: str
    body: dict

    @property
    def model(self) -> str | None:
        return self.body.get("model")

    def prefix_key(self) -> str:
        """What lines sharing a prompt prefix have in common at their start: sorting by it runs them together so the
        engine's prefix cache pays."""
        if self.url == "/v1/chat/completions":
            return json.dumps(self.body.get("messages"), ensure_ascii=False)[:4096]
        prompt = self.body.get("prompt")
        return prompt[:4096] if isinstance(prompt, str) else json.dumps(prompt)[:4096]


@dataclass
class LineError:
    line: int | None
    message: str
    param: str | None = None
    code: str = "invalid_request"

    def as_openai(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def window_seconds(window: str) -> float:
    """`completion_window` ("24h", OpenAI's one value; Summit also takes e.g. "90m", "3600s", "2d")."""
    m = _WINDOW.match(window.strip()) if isinstance(window, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"completion_window must be a duration such as '24h' (or 's', 'm', 'd'); got {window!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_lines(
    data: bytes, endpoint: str | None, models: Sequence[str], max_lines: int
) -> tuple[list[Line], list[LineError]]:
    """Every line of an input file checked; the lines, and an error per bad line naming its number and field.
    `endpoint`: the url every line must have (a batch's); None: either (the offline command)."""
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: dict[str, int] = {}
    raw_lines = data.splitlines()
    if sum(1 for r in raw_lines if r.strip()) > max_lines:
        return [], [
            LineError(
                None, f"the file has more than {max_lines} requests (the batch line limit)", code="too_many_requests"
            )
        ]
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            errors.append(LineError(number, f"line {number} is not valid JSON: {e}", code="invalid_json_line"))
            continue
        if not isinstance(obj, dict):
            errors.append(LineError(number, f"line {number} must be a JSON object", code="invalid_json_line"))
            continue
        problem = _line_problem(number, obj, endpoint, models, seen)
        if problem:
            errors.append(problem)
            continue
        seen[obj["custom_id"]] = number
        lines.append(Line(number, obj["custom_id"], obj["url"], obj["body"]))
    if not lines and not errors:
        errors.append(LineError(None, "the input file has no requests", code="empty_file"))
    return lines, errors


def _line_problem(
    number: int, obj: dict, endpoint: str | None, models: Sequence[str], seen: dict[str, int]
) -> LineError | None:
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(number, f"line {number}: `custom_id` is missing or not a string", "custom_id")
    if custom_id in seen:
        return LineError(
            number,
            f"line {number}: custom_id {custom_id!r} repeats line {seen[custom_id]}; each line needs its own",
            "custom_id",
            code="duplicate_custom_id",
        )
    if obj.get("method", "POST") != "POST":
        return LineError(number, f"line {number}: `method` must be POST", "method")
    url = obj.get("url")
    if url not in URLS:
        return LineError(number, f"line {number}: `url` {url!r} is not served; use one of {', '.join(URLS)}", "url")
    if endpoint is not None and url != endpoint:
        return LineError(number, f"line {number}: `url` {url} differs from the batch's endpoint {endpoint}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(number, f"line {number}: `body` must be a JSON object", "body")
    model = body.get("model")
    if model is None and len(models) == 1:
        body["model"] = models[0]
    elif model not in models:
        return LineError(
            number,
            f"line {number}: model {model!r} is not served here; served: {', '.join(models)}",
            "body.model",
            code="model_not_found",
        )
    if body.get("stream"):
        return LineError(number, f"line {number}: `body.stream` must be false in a batch", "body.stream")
    return None


def grouped(lines: Iterable[Line]) -> list[Line]:
    """Lines in the order to run them: sharing a prompt prefix, together (stable: input order otherwise)."""
    return sorted(lines, key=lambda line: (line.model or "", line.prefix_key()))


def result_line(line: Line, status: int, body: dict | None, request_id: str) -> dict:
    """The output (2xx) or error-file line for a request the engine answered."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def unrun_line(line: Line, code: str, message: str) -> dict:
    """The error-file line for a request that never ran (its batch expired or was cancelled first)."""
    return {
        "id": new_id("batch_req_"),
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
