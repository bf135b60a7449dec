"""LoRA adapters added and removed while the application runs (`models[].lora.runtime_loading`), through vLLM's own
routes and bodies: `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
{"lora_name"}`; with several models that allow it, `"model"` in the body names the base model.

Only behind API keys (the config refuses runtime_loading without `auth`). The replica that takes a load request loads
the adapter into its own engine (a replica of the base model: the request is handed to one otherwise), so a bad path
or rank is the caller's 400 and nothing is kept; then the AdapterRegistry deployment records it for the application,
with the replica that loaded it (its home). Every engine replica reads the registry each second (LLMServer) and serves
what it lists from then on: the name is a model in `/v1/models`, requests for it are routed like the YAML's adapters
(to a replica that has it loaded), a new or restarted replica knows it. Each replica reports the homes it knows beside
its adapters, so that a router that hears of the adapter from any replica's report knows where it is loaded, even
before the home's own report of its loaded adapters reaches it. Unloading removes it from the registry; each replica
forgets it and drops its weights once no request uses them. The registry lives in memory: when the application is
redeployed or the registry's replica restarts, adapters loaded at run time are gone (as with vLLM's own server) and
are loaded again by the caller.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Protocol

from deployments.http.errors import OpenAIError
from deployments.http.routes import LORA_LOAD, LORA_UNLOAD
from deployments.lora.adapters import Adapters

logger = logging.getLogger("ray.serve")

LOAD, UNLOAD = LORA_LOAD, LORA_UNLOAD
SYNC_PERIOD_S = 1.0
MAX_BODY_BYTES = 64 * 1024  # a name and a path


def _name(payload: dict) -> str:
    name = payload.get("lora_name")
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise OpenAIError(
            400, "`lora_name` is required: a name without spaces, used as the OpenAI `model`", param="lora_name"
        )
    return name


def parse_load(payload: object, runtime_models: list[str], taken: set[str]) -> tuple[str, str, str]:
    """(name, path, base model) of a load request; refusals are raised (OpenAIError). `taken`: every model and
    adapter name now."""
    if not isinstance(payload, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    name = _name(payload)
    path = payload.get("lora_path")
    if not isinstance(path, str) or not path:
        raise OpenAIError(
            400, "`lora_path` is required: a PEFT adapter directory on the model's nodes", param="lora_path"
        )
    base = payload.get("model")
    if base is None:
        if len(runtime_models) != 1:
            raise OpenAIError(
                400, f"`model` is required: the base model, one of {', '.join(runtime_models)}", param="model"
            )
        base = runtime_models[0]
    if base not in runtime_models:
        raise OpenAIError(
            404 if not isinstance(base, str) or base not in taken else 400,
            f"model {base!r} does not take adapters at run time; those that do: "
            f"{', '.join(runtime_models)} (models[].lora.runtime_loading)",
            param="model",
        )
    if name in taken:
        raise OpenAIError(
            400, f"The lora adapter '{name}' has already been loaded (or is a model's name)", param="lora_name"
        )
    return name, path, base


def parse_unload(payload: object, yaml_adapters: set[str]) -> str:
    if not isinstance(payload, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    name = _name(payload)
    if name in yaml_adapters:
        raise OpenAIError(
            400,
            f"adapter '{name}' is listed in the Serve YAML (models[].lora.adapters); remove it there",
            param="lora_name",
        )
    return name


def check_adapter_dir(path: str) -> None:
    """The path, on this node, holds a PEFT adapter (vLLM reads adapter_config.json first)."""
    if not os.path.isfile(os.path.join(os.path.expanduser(path), "adapter_config.json")):
        raise OpenAIError(
            400,
            f"lora_path {path!r}: no adapter_config.json there on this node (the path must hold "
            "the adapter on every node that runs the model)",
            param="lora_path",
        )


class AdapterRegistry:
    """The application's adapters added at run time: name -> (base model, path, home: the replica that loaded it). A
    Serve deployment of one replica."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, str, str]] = {}
        self._version = 0

    def add(self, name: str, base: str, path: str, home: str = "") -> bool:
        """False when the name is taken (two loads of one name at once: the second loses)."""
        if name in self._entries:
            return False
        self._entries[name] = (base, path, home)
        self._version += 1
        logger.info("LoRA adapter %s of %s registered (%s)", name, base, path)
        return True

    def remove(self, name: str) -> bool:
        if self._entries.pop(name, None) is None:
            return False
        self._version += 1
        logger.info("LoRA adapter %s unregistered", name)
        return True

    def snapshot(self) -> tuple[int, dict[str, tuple[str, str, str]]]:
        return self._version, dict(self._entries)


class ModelNames(Protocol):
    """What runtime loading may read and change of a replica front's model table (server/models.ModelTable)."""

    model: str  # the replica's own model
    adapters: Adapters | None  # the adapters its engine may load

    def taken(self) -> set[str]: ...

    def learn(self, name: str, base: str, path: str, engine_path: str | None = None) -> None: ...

    async def forget(self, name: str) -> None: ...


class RuntimeAdapters:
    """One replica's view of the registry, applied to its front's model table (server/models.py): names it knows
    and, for its own model, the adapters its engine may load (lora/adapters.py)."""

    def __init__(self, registry, runtime_models: list[str], yaml_adapters: set[str], replica_id: str = ""):
        self.registry = registry  # a DeploymentHandle to the AdapterRegistry
        self.runtime_models = list(runtime_models)
        self.yaml_adapters = set(yaml_adapters)
        self.replica_id = replica_id  # this replica's: a load it takes makes it the adapter's home
        self.homes: dict[str, str] = {}  # adapter -> the replica that loaded it (reported to the routers)
        self._version = -1
        self._applied: set[str] = set()

    async def refresh(self, table: ModelNames) -> None:
        version, entries = await self.registry.snapshot.remote()
        if version != self._version:
            self._version = version
            await self.apply(table, entries)

    async def apply(self, table: ModelNames, entries: dict[str, tuple[str, str, str]]) -> None:
        for name in self._applied - set(entries):
            await self.forget(table, name)
        for name, (base, path, home) in entries.items():
            self.learn(table, name, base, path, home)

    def learn(self, table: ModelNames, name: str, base: str, path: str, home: str) -> None:
        self._applied.add(name)
        if home:
            self.homes[name] = home
        table.learn(name, base, path, os.path.expanduser(path))

    async def forget(self, table: ModelNames, name: str) -> None:
        self._applied.discard(name)
        self.homes.pop(name, None)
        await table.forget(name)

    async def handle(
        self, table: ModelNames, path: str, payload: object, forward: Callable[[str], Awaitable[None]] | None
    ) -> tuple[int, str] | None:
        """(status, text) of a load/unload request on this replica, or None once `forward(base)` has handed it to a
        replica of `base`, which answered the client. Refusals are raised (OpenAIError)."""
        if path == UNLOAD:
            name = parse_unload(payload, self.yaml_adapters)
            if not await self.registry.remove.remote(name):
                raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
            await self.forget(table, name)
            return 200, f"Success: LoRA adapter '{name}' removed successfully."
        name, adapter_path, base = parse_load(payload, self.runtime_models, table.taken())
        if base != table.model:  # its engine must load it first: a replica of the base model answers
            await forward(base)
            return None
        check_adapter_dir(adapter_path)
        if not await self.registry.add.remote(name, base, adapter_path, self.replica_id):
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded", param="lora_name")
        self.homes[name] = self.replica_id  # reported while it loads: the routers send its first requests here
        try:
            await self._load_now(table, name, adapter_path)
        except OpenAIError:
            self.homes.pop(name, None)
            raise
        self.learn(table, name, base, adapter_path, self.replica_id)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    async def _load_now(self, table: ModelNames, name: str, adapter_path: str) -> None:
        """Load it into this engine before answering: a bad adapter is this request's error, and nothing is kept."""
        table.adapters.paths[name] = os.path.expanduser(adapter_path)
        try:
            async with table.adapters.use(name):
                pass
        except Exception as e:
            table.adapters.paths.pop(name, None)
            await self.registry.remove.remote(name)
            raise OpenAIError(400, str(e), param="lora_path") from None
