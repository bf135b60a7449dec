"""A replica's engine asleep or awake (`deployment.sleep`, `models[].share_with`; vLLM's sleep mode).

Every request that needs the engine holds a `use()` while it runs; a request that finds the engine asleep waits for
it to wake (it is not refused). The engine sleeps only when no request runs: after `after_idle_s` without requests,
or — where models share a GPU (deployments/server/gpu_share.py) — when another model waits for the GPU and this one
has been awake `min_awake_s`: it then lets no new request start, lets the running ones finish (never mid-stream),
sleeps and passes the turn on; requests that came meanwhile wait for the next turn, in arrival order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

from app.config.options import SleepOptions
from deployments.http.errors import OpenAIError

logger = logging.getLogger("ray.serve")


class EngineSleep(Protocol):
    async def sleep(self, level: int) -> None: ...

    async def wake(self, level: int) -> None: ...


class Turns(Protocol):
    """The GPU's token where models share it (gpu_share.ShareGroupClient)."""

    async def acquire(self) -> None: ...

    async def release(self) -> None: ...

    async def wanted(self, timeout_s: float = ...) -> bool: ...


class Sleeper:
    def __init__(self, engine: EngineSleep, options: SleepOptions, turns: Turns | None = None, model: str = ""):
        self._engine, self.options, self._turns, self.model = engine, options, turns, model
        self._cond = asyncio.Condition()
        self.awake = self.admitting = False
        self.in_flight = self.waiting = 0
        self._busy = False  # a wake or a sleep under way
        self._waking = False  # a wake under way
        self._error: str | None = None  # why the last wake failed (its waiters are answered 503)
        self._tries = self._failed_try = 0  # wakes begun; the last that failed
        self.last_used = self.awake_since = time.monotonic()
        # last_*_s: how long the last wake / sleep took; woke_at: when the last wake began (epoch s, its GPU turn
        # held), slept_at: when the last sleep ended (before the turn passed on)
        self.counts: dict[str, Any] = {
            "sleeps": 0,
            "wakes": 0,
            "last_wake_s": None,
            "last_sleep_s": None,
            "woke_at": None,
            "slept_at": None,
        }
        self._tasks: set[asyncio.Task] = set()

    async def start(self, start_engine: Callable[[], Awaitable[Any]]) -> Any:
        """Starts the engine in this replica's turn (models sharing a GPU start one at a time: an engine sizes its KV
        cache from the memory free when it starts); the engine is then awake."""
        if self._turns is not None:
            await self._turns.acquire()
        started = await start_engine()
        self.awake = self.admitting = True
        self.awake_since = self.last_used = time.monotonic()
        if self._turns is not None:
            self._spawn(self._watch_turn())
        if self.options.after_idle_s is not None:
            self._spawn(self._watch_idle())
        return started

    @asynccontextmanager
    async def use(self) -> AsyncIterator[None]:
        """Held by a request while it runs on the engine; waits for the engine to wake (and its turn) first."""
        async with self._cond:
            self.waiting += 1
            first_try = self._tries + (0 if self._waking else 1)  # the first wake this request waits for
            try:
                while not (self.awake and self.admitting):
                    if self._failed_try >= first_try:
                        raise OpenAIError.unavailable(f"The engine of {self.model} could not wake: {self._error}")
                    if not self.awake and not self._busy:
                        self._busy = self._waking = True
                        self._tries += 1
                        self._spawn(self._wake())
                    await self._cond.wait()
            finally:
                self.waiting -= 1
            self.in_flight += 1
        try:
            yield
        finally:
            async with self._cond:
                self.in_flight -= 1
                self.last_used = time.monotonic()
                self._cond.notify_all()

    async def _wake(self) -> None:
        error = None
        try:
            if self._turns is not None:
                await self._turns.acquire()
            began = time.monotonic()
            self.counts["woke_at"] = time.time()
            await self._engine.wake(self.options.level)
            self.counts["wakes"] += 1
            self.counts["last_wake_s"] = round(time.monotonic() - began, 3)
            logger.info("engine of %s awake in %.2f s", self.model, self.counts["last_wake_s"])
        except Exception as e:  # noqa: BLE001 — the waiters are told; the next request tries again
            logger.exception("engine of %s failed to wake", self.model)
            error = f"{type(e).__name__}: {e}"
            if self._turns is not None:
                await self._turns.release()
        async with self._cond:
            self._busy = self._waking = False
            self._error = error
            if error is not None:
                self._failed_try = self._tries
            else:
                self.awake = self.admitting = True
                self.awake_since = self.last_used = time.monotonic()
                if self._turns is not None:
                    self._spawn(self._watch_turn())
            self._cond.notify_all()

    async def put_to_sleep(self, why: str) -> bool:
        """Stops taking requests, waits for the running ones, sleeps the engine, passes the GPU's turn on. False when
        it was not awake (or a wake or sleep was under way)."""
        async with self._cond:
            if not self.awake or self._busy:
                return False
            self._busy, self.admitting = True, False
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight == 0)
        began = time.monotonic()
        slept = await self._sleep_engine()
        if not slept:
            return False
        self.counts["sleeps"] += 1
        self.counts["slept_at"] = time.time()
        self.counts["last_sleep_s"] = round(time.monotonic() - began, 3)
        logger.info("engine of %s asleep (%s) in %.2f s", self.model, why, self.counts["last_sleep_s"])
        if self._turns is not None:  # before anyone may ask again: a new wake queues behind the waiting models
            try:
                await self._turns.release()
            except Exception:  # noqa: BLE001 — the group's actor is gone: a new one starts with no holder
                logger.exception("GPU share group of %s unreachable to pass the turn on", self.model)
        async with self._cond:
            self.awake = self._busy = False
            self._cond.notify_all()
        return True

    async def _sleep_engine(self) -> bool:
        try:
            await self._engine.sleep(self.options.level)
        except Exception:  # noqa: BLE001 — it goes on serving awake
            logger.exception("engine of %s failed to sleep: it stays awake", self.model)
            async with self._cond:
                self._busy, self.admitting = False, True
                self._cond.notify_all()
            return False
        return True

    async def _watch_turn(self) -> None:
        """The holder's side of the GPU's turns: yields once another model waits and this one was awake long
        enough."""
        awake_since = self.awake_since  # this waking's watch: ends with it
        while self.awake and self.awake_since == awake_since:
            try:
                wanted = await self._turns.wanted()
            except Exception:  # noqa: BLE001 — the group's actor is gone for good: keep serving, try again
                logger.exception("GPU share group of %s unreachable", self.model)
                await asyncio.sleep(1.0)
                continue
            if wanted:
                await asyncio.sleep(max(0.0, self.awake_since + self.options.min_awake_s - time.monotonic()))
                if await self.put_to_sleep("another model waits for the GPU"):
                    return
                await asyncio.sleep(1.0)  # its engine failed to sleep (logged): try again, not at once

    async def _watch_idle(self) -> None:
        after = float(self.options.after_idle_s)
        while True:
            await asyncio.sleep(min(1.0, after / 4))
            idle = self.awake and not self._busy and self.in_flight == 0 and self.waiting == 0
            if idle and time.monotonic() - self.last_used >= after:
                await self.put_to_sleep(f"idle {after:g} s")

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stats(self) -> dict[str, Any]:
        return {
            "asleep": not self.awake,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "level": self.options.level,
            **self.counts,
        }

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
