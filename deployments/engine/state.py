"""A running engine's state as Summit's replica asks it: alive or dead, requests it still holds; its shutdown."""

from __future__ import annotations


async def check_engine_health(engine) -> None:
    """Raises (vLLM's EngineDeadError) when the engine core is gone."""
    await engine.check_health()


def engine_is_dead(engine) -> bool:
    return bool(engine.errored)


def num_unfinished_requests(engine) -> int:
    """Requests the engine still holds (running or waiting), as vLLM's output processor counts them."""
    return engine.output_processor.get_num_unfinished_requests()


def shutdown_engine(engine) -> None:
    engine.shutdown()
