"""The batch runner's core, shared by the online runner (deployments/batch/runner.py) and the offline command
(`summit batch`): run lines in groups through a `send_group` with bounded concurrency, ordered by prompt prefix,
retrying what the engines turn away for now (overload, a replica being replaced), and hand each finished line to
`done` once.
Pure asyncio: no Ray, no vLLM, no HTTP."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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


SendGroup = Callable[[list[Line]], AsyncIterator[tuple[Line, Answer]]]
Done = Callable[[Line, bool, dict, int], Awaitable[None]]


async def run_lines(
    lines: Sequence[Line],
    send_group: SendGroup,
    done: Done,
    concurrency: int,
    group_size: int = 16,
    stopped: Callable[[], bool] = lambda: False,
    retry_s: float = 0.5,
    max_retry_s: float = 10.0,
) -> int:
    """Run every line (grouped by prefix) with at most `concurrency` in flight, in groups of at most `group_size`
    lines of one model per `send_group` call (which yields each line's answer as it finishes); `done(line, ok,
    result_line, output_tokens)` for each finished one. A line answered with a retry status, or not answered by a
    group call that failed (Unavailable), runs again after a back-off. Stops starting lines once `stopped()` is true
    (lines in flight finish; lines waiting to be retried never ran). The number of lines finished."""
    pending = collections.deque(grouped(lines))
    size = max(1, min(group_size, concurrency))
    finished = 0

    async def worker() -> None:
        nonlocal finished
        delay = retry_s
        while pending and not stopped():
            group = [pending.popleft()]
            while pending and len(group) < size and pending[0].model == group[0].model:
                group.append(pending.popleft())
            unanswered = {id(line): line for line in group}
            again: list[Line] = []
            why = ""
            try:
                async for line, answer in send_group(group):
                    unanswered.pop(id(line), None)
                    if answer.status in RETRY_STATUSES:
                        again.append(line)
                        why = f"status {answer.status}"
                        continue
                    ok = 200 <= answer.status < 300
                    tokens = ((answer.body or {}).get("usage") or {}).get("completion_tokens", 0) if ok else 0
                    await done(line, ok, result_line(line, answer.status, answer.body, answer.request_id), tokens)
                    finished += 1
            except Unavailable as e:
                why = str(e)
            again += unanswered.values()
            if not again:
                delay = retry_s
                continue
            if stopped():
                return
            logger.info("batch: %d lines (first: %s): %s; retried in %.1f s", len(again), again[0].number, why, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(max_retry_s, delay * 2)
            pending.extendleft(reversed(again))

    workers = max(1, -(-concurrency // size))
    await asyncio.gather(*(worker() for _ in range(workers)))
    return finished
