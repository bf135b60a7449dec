"""A replica's LoRA adapters (`models[].lora`): loaded into its engine on the first request that names one, at most
`max_loras` at once (the least recently used idle one is unloaded to make room), and reported to Summit's routers
(LLMServer.record_routing_stats), which send an adapter's requests to a replica that has it loaded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable

logger = logging.getLogger("ray.serve")


class AdapterLoadError(Exception):
    """vLLM could not load the adapter (its path, its rank, its modules); the message says why."""


class Adapters:
    def __init__(
        self,
        paths: dict[str, str],
        max_loaded: int,
        load: Callable[[str, str], Awaitable[str | None]],
        unload: Callable[[str], Awaitable[None]],
    ):
        """`paths`: adapter name -> directory; `load(name, path)`: the error, or None once loaded; `unload(name)`."""
        self.paths = dict(paths)
        self.max_loaded = max_loaded
        self._load, self._unload = load, unload
        self._loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._in_use: Counter[str] = Counter()
        self._lock = asyncio.Lock()

    def loaded(self) -> list[str]:
        return list(self._loaded)

    @contextlib.asynccontextmanager
    async def use(self, name: str):
        """Hold `name` loaded while the request runs (loading it first, unloading another if the replica is full)."""
        if name not in self._loaded:
            async with self._lock:
                if name not in self._loaded:
                    await self._make_room()
                    error = await self._load(name, self.paths[name])
                    if error is not None:
                        raise AdapterLoadError(f"LoRA adapter {name!r} could not be loaded: {error}")
                    logger.info(
                        "LoRA adapter %s loaded from %s (%d of %d)",
                        name,
                        self.paths[name],
                        len(self._loaded) + 1,
                        self.max_loaded,
                    )
                    self._loaded[name] = None
        self._loaded.move_to_end(name)
        self._in_use[name] += 1
        try:
            yield
        finally:
            self._in_use[name] -= 1

    async def _make_room(self) -> None:
        while len(self._loaded) >= self.max_loaded:
            idle = next((n for n in self._loaded if self._in_use[n] == 0), None)
            if idle is None:  # every loaded adapter runs a request: vLLM's own cache makes room (it reloads on need)
                return
            del self._loaded[idle]
            await self._unload(idle)
            logger.info("LoRA adapter %s unloaded to make room", idle)

    async def forget(self, name: str) -> None:
        """Stop serving `name` (unloaded at run time): its weights leave the engine now if no request uses them, else
        when room is made for another adapter."""
        self.paths.pop(name, None)
        async with self._lock:
            if name in self._loaded and self._in_use[name] == 0:
                del self._loaded[name]
                await self._unload(name)
                logger.info("LoRA adapter %s unloaded (removed at run time)", name)
