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
    flight = _Flight(lines, send_group, done, stopped, retry_s, max_retry_s)
    return await flight.run(concurrency, max(1, min(group_size, concurrency)))


class _Flight:
    """run_lines' state: the lines waiting, in flight and waiting to be retried, and the group calls running."""

    def __init__(self, lines, send_group: SendGroup, done: Done, stopped, retry_s: float, max_retry_s: float):
        self.pending = collections.deque(grouped(lines))
        self.send_group, self.done, self.stopped = send_group, done, stopped
        self.retry_s, self.max_retry_s, self.delay = retry_s, max_retry_s, retry_s
        self.in_flight = self.retrying = self.finished = 0
        self.changed = asyncio.Event()
        self.errors: list[BaseException] = []
        self.tasks: set[asyncio.Task] = set()

    async def run(self, concurrency: int, size: int) -> int:
        try:
            while not self.errors and not self.stopped() and (self.pending or self.in_flight or self.retrying):
                while self.pending and concurrency - self.in_flight >= min(size, len(self.pending)):
                    self._start(self._next_group(min(size, concurrency - self.in_flight)))
                self.changed.clear()
                await self.changed.wait()
            if self.tasks and not self.errors:  # stopped: the lines in flight finish
                await asyncio.gather(*self.tasks)
            if self.errors:
                raise self.errors[0]
        finally:
            for task in self.tasks:
                task.cancel()
        return self.finished

    def _next_group(self, room: int) -> list[Line]:
        group = [self.pending.popleft()]
        while self.pending and len(group) < room and self.pending[0].model == group[0].model:
            group.append(self.pending.popleft())
        return group

    def _start(self, group: list[Line]) -> None:
        self.in_flight += len(group)
        task = asyncio.create_task(self._guarded(group))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guarded(self, group: list[Line]) -> None:
        try:
            await self._send(group)
        except Exception as e:  # noqa: BLE001 — raised by run(), which cancels the other groups
            self.errors.append(e)
            self.changed.set()

    async def _send(self, group: list[Line]) -> None:
        unanswered = {id(line): line for line in group}
        again: list[Line] = []
        why = ""
        try:
            async for line, answer in self.send_group(group):
                if unanswered.pop(id(line), None) is None:
                    continue
                self.in_flight -= 1
                self.changed.set()
                if answer.status in RETRY_STATUSES:
                    again.append(line)
                    why = f"status {answer.status}"
                    continue
                ok = 200 <= answer.status < 300
                tokens = ((answer.body or {}).get("usage") or {}).get("completion_tokens", 0) if ok else 0
                await self.done(line, ok, result_line(line, answer.status, answer.body, answer.request_id), tokens)
                self.finished += 1
        except Unavailable as e:
            why = str(e)
        finally:
            self.in_flight -= len(unanswered)
            self.changed.set()
        again += unanswered.values()
        if not again:
            self.delay = self.retry_s
        elif not self.stopped():
            await self._retry(again, why)

    async def _retry(self, again: list[Line], why: str) -> None:
        logger.info("batch: %d lines (first: %s): %s; retried in %.1f s", len(again), again[0].number, why, self.delay)
        self.retrying += len(again)
        try:
            wait, self.delay = self.delay * (0.5 + random.random()), min(self.max_retry_s, self.delay * 2)
            await asyncio.sleep(wait)
            self.pending.extendleft(reversed(again))
        finally:
            self.retrying -= len(again)
            self.changed.set()
