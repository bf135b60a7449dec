"""A replica's LoRA adapters (deployments/lora/adapters.py) with a recording fake of vLLM's load/unload, and the YAML's
`lora:` key (app/config/lora.py, app/config/__init__.py)."""

from __future__ import annotations

import asyncio

import pytest

from app.config import SummitConfig
from deployments.engine import engine_args
from deployments.lora.adapters import AdapterLoadError, Adapters


def make(max_loaded: int = 2, fail: set[str] = frozenset()):
    calls: list[tuple[str, str]] = []

    async def load(name: str, path: str) -> str | None:
        await asyncio.sleep(0.01)
        calls.append(("load", name))
        return "no such directory" if name in fail else None

    async def unload(name: str) -> None:
        calls.append(("unload", name))

    return Adapters({n: f"/adapters/{n}" for n in "abcd"}, max_loaded, load, unload), calls


def test_adapters_load_once_and_unload_the_least_recently_used_idle_one():
    async def scenario():
        adapters, calls = make()

        async def request(name: str, hold_s: float = 0.0):
            async with adapters.use(name):
                await asyncio.sleep(hold_s)

        await asyncio.gather(*(request("a") for _ in range(5)))  # five at once: one load
        await request("b")
        await request("a")  # a is now the most recently used: b goes first
        await request("c")
        loaded_after_c = adapters.loaded()
        busy = asyncio.create_task(request("a", 0.2))  # a in use: c, idle, is unloaded for d
        await asyncio.sleep(0.05)
        await request("d")
        await busy
        return calls, loaded_after_c, adapters.loaded()

    calls, loaded_after_c, loaded = asyncio.run(scenario())
    assert calls == [("load", "a"), ("load", "b"), ("unload", "b"), ("load", "c"), ("unload", "c"), ("load", "d")]
    assert loaded_after_c == ["a", "c"] and loaded == ["a", "d"]


def test_an_adapter_that_fails_to_load_raises_and_is_not_counted_loaded():
    async def scenario():
        adapters, _ = make(fail={"b"})
        with pytest.raises(AdapterLoadError, match="'b' could not be loaded: no such directory"):
            async with adapters.use("b"):
                pass
        return adapters.loaded()

    assert asyncio.run(scenario()) == []


def model(**fields) -> dict:
    return {"name": "tiny", "source": "/m", "accelerator": "cpu", **fields}


def test_lora_yaml_sets_vllms_engine_args_and_names_clashes():
    config = SummitConfig.model_validate(
        {"models": [model(lora={"adapters": [{"name": "sql", "path": "/a/sql"}], "max_loras": 3})]}
    )
    args = engine_args(config.models[0])
    assert (args["enable_lora"], args["max_loras"], args["max_cpu_loras"], args["max_lora_rank"]) == (True, 3, 3, 16)
    assert config.models[0].adapter_names == ["sql"]
    with pytest.raises(ValueError, match=r"engine_kwargs.max_loras: LoRA is set with the model's `lora:` key"):
        SummitConfig.model_validate(
            {"models": [model(engine_kwargs={"max_loras": 2}, lora={"adapters": [{"name": "s", "path": "/a"}]})]}
        )
    with pytest.raises(ValueError, match="must be unique; repeated: tiny"):
        SummitConfig.model_validate({"models": [model(lora={"adapters": [{"name": "tiny", "path": "/a"}]})]})
    with pytest.raises(ValueError, match="lora.adapters"):
        SummitConfig.model_validate({"models": [model(lora={"adapters": []})]})
