"""The batch runner's core, shared by the online runner (deployments/batch/runner.py) and the offline command
(`summit batch`): run lines through a `send` with bounded concurrency, grouped by prompt prefix, retrying what the
engines turn away for now (overload, a replica being replaced), and hand each finished line to `done` once.
Pure asyncio: no Ray, no vLLM, no HTTP."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from deployments.batch.lines import Line, grouped, result_line

logger = logging.getLogger("ray.serve")

# Statuses a batch line is retried on instead of recorded: the engine side is busy or being replaced.
RETRY_STATUSES = frozenset({429, 502, 503, 504})


@dataclass
class Answer:
    status: int
    body: dict | None
    request_id: str


class Unavailable(Exception):
    """No replica could take the line now (retried)."""


Send = Callable[[Line], Awaitable[Answer]]
Done = Callable[[Line, bool, dict, int], Awaitable[None]]


async def run_lines(
    lines: Sequence[Line],
    send: Send,
    done: Done,
    concurrency: int,
    stopped: Callable[[], bool] = lambda: False,
    retry_s: float = 0.5,
    max_retry_s: float = 10.0,
) -> int:
    """Run every line (grouped by prefix) with at most `concurrency` in flight; `done(line, ok, result_line,
    output_tokens)` for each finished one. Stops starting lines once `stopped()` is true (lines in flight finish).
    The number of lines finished."""
    queue = grouped(lines)
    position = 0
    finished = 0

    async def worker() -> None:
        nonlocal position, finished
        while position < len(queue) and not stopped():
            line = queue[position]
            position += 1
            answer = await _until_answered(line, send, stopped, retry_s, max_retry_s)
            if answer is None:  # stopped while it waited to be retried: it never ran
                continue
            ok = 200 <= answer.status < 300
            tokens = ((answer.body or {}).get("usage") or {}).get("completion_tokens", 0) if ok else 0
            await done(line, ok, result_line(line, answer.status, answer.body, answer.request_id), tokens)
            finished += 1

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return finished


async def _until_answered(
    line: Line, send: Send, stopped: Callable[[], bool], retry_s: float, max_retry_s: float
) -> Answer | None:
    delay = retry_s
    while True:
        try:
            answer = await send(line)
            if answer.status not in RETRY_STATUSES:
                return answer
            why = f"status {answer.status}"
        except Unavailable as e:
            why = str(e)
        if stopped():
            return None
        logger.info("batch line %s (%s): %s; retried in %.1f s", line.number, line.custom_id, why, delay)
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(max_retry_s, delay * 2)
