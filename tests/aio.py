"""Waiting inside an asyncio test on a state, not on a time."""

from __future__ import annotations

import asyncio


async def until(condition, limit_s: float = 30.0) -> None:
    """Wait until `condition()` holds (the event loop runs meanwhile); fails after `limit_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not condition():
        assert loop.time() < deadline, "the condition never held"
        await asyncio.sleep(0.001)
