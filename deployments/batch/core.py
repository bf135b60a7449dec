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
    result_line, output_tokens)` for each finished one. Each answered line frees its place at once: a new group goes
    out as soon as a group's worth of places is free, not when a whole group has ended (a group's slowest line would
    leave the others' places empty). A line answered with a retry status, or not answered by a group call that failed
    (Unavailable), runs again after a back-off. Stops starting lines once `stopped()` is true (lines in flight finish;
    lines waiting to be retried never ran). The number of lines finished."""
    pending = collections.deque(grouped(lines))
    size = max(1, min(group_size, concurrency))
    in_flight = retrying = finished = 0
    delay = retry_s
    changed = asyncio.Event()

    async def send(group: list[Line]) -> None:
        nonlocal in_flight, retrying, finished, delay
        unanswered = {id(line): line for line in group}
        again: list[Line] = []
        why = ""
        try:
            async for line, answer in send_group(group):
                if unanswered.pop(id(line), None) is None:
                    continue
                in_flight -= 1
                changed.set()
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
        finally:
            in_flight -= len(unanswered)
            changed.set()
        again += unanswered.values()
        if not again:
            delay = retry_s
            return
        if stopped():
            return
        logger.info("batch: %d lines (first: %s): %s; retried in %.1f s", len(again), again[0].number, why, delay)
        retrying += len(again)
        try:
            wait, delay = delay * (0.5 + random.random()), min(max_retry_s, delay * 2)
            await asyncio.sleep(wait)
            pending.extendleft(reversed(again))
        finally:
            retrying -= len(again)
            changed.set()

    errors: list[BaseException] = []
    tasks: set[asyncio.Task] = set()

    async def guarded(group: list[Line]) -> None:
        try:
            await send(group)
        except Exception as e:  # noqa: BLE001 — raised by run_lines, which cancels the other groups
            errors.append(e)
            changed.set()

    try:
        while not errors and not stopped() and (pending or in_flight or retrying):
            while pending and concurrency - in_flight >= min(size, len(pending)):
                group, room = [pending.popleft()], min(size, concurrency - in_flight)
                while pending and len(group) < room and pending[0].model == group[0].model:
                    group.append(pending.popleft())
                in_flight += len(group)
                task = asyncio.create_task(guarded(group))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            changed.clear()
            await changed.wait()
        if tasks and not errors:  # stopped: the lines in flight finish
            await asyncio.gather(*tasks)
        if errors:
            raise errors[0]
    finally:
        for task in tasks:
            task.cancel()
    return finished
