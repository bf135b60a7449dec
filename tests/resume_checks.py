"""Client side of resumable streams (`stream_resume`) for the real-engine tests: a raw SSE stream read with httpx as a
client reads it (each event's `id:` and `data:`), dropped after some events, resumed with `Last-Event-ID`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx


@dataclass
class Read:
    """What one connection got: its events as (id, data) in order, the response headers, whether it reached [DONE]."""

    status: int = 0
    headers: dict = field(default_factory=dict)
    events: list[tuple[str | None, str]] = field(default_factory=list)
    done: bool = False
    body: str = ""

    @property
    def last_id(self) -> str:
        return self.events[-1][0]

    def numbers(self) -> list[int]:
        return [int(i.rsplit(":", 1)[1]) for i, _ in self.events]


def read_stream(url: str, body: dict | None, headers: dict, stop_after: int | None = None, timeout=120) -> Read:
    """POST `body` (None: an empty body, as a resume may send) and read the SSE answer; with `stop_after`, close the
    connection after that many events (the client drops)."""
    out = Read()
    content = json.dumps(body).encode() if body is not None else b""
    with httpx.Client(timeout=timeout) as client:
        hdrs = {"content-type": "application/json", **headers}
        with client.stream("POST", url, content=content, headers=hdrs) as r:
            out.status, out.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                r.read()
                out.body = r.text
                return out
            event_id = None
            for line in r.iter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: "):
                    out.events.append((event_id, line[6:]))
                    event_id = None
                    out.done = line == "data: [DONE]"
                    if stop_after is not None and len(out.events) >= stop_after:
                        return out  # leaving the block closes the connection mid-stream
    return out


def text_of(events: list[tuple[str | None, str]]) -> str:
    """The generated text of a completion or chat stream's events."""
    text = ""
    for _, data in events:
        if data.startswith("{"):
            for choice in json.loads(data).get("choices") or []:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def same_stream(first: Read, rest: Read) -> list[str]:
    """The ids of a dropped connection's events and its resume's, as one stream: 1..N, each once, in order."""
    numbers = first.numbers() + rest.numbers()
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    streams = {i.rsplit(":", 1)[0] for i, _ in first.events + rest.events}
    assert streams == {first.headers["x-summit-stream-id"]}, streams
    return [i for i, _ in first.events + rest.events]


def parsed(lines: list[str]) -> dict:
    """A completion or chat stream's lines (only its `data:` lines are read): its text, token ids (when asked), usage,
    chunk ids, error events, whether [DONE] came, and how many events."""
    seen = {"text": "", "ids": [], "usage": None, "errors": [], "chunk_ids": set(), "done": False, "events": 0}
    for line in lines:
        if not line.startswith("data: "):  # SSE `id:` lines, blank lines
            continue
        if line == "data: [DONE]":
            seen["done"] = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            seen["errors"].append(chunk["error"])
            continue
        seen["chunk_ids"].add(chunk["id"])
        seen["usage"] = chunk.get("usage") or seen["usage"]
        for choice in chunk["choices"]:
            seen["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            seen["ids"] += choice.get("token_ids") or []
        seen["events"] += 1
    return seen
