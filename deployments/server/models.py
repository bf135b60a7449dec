"""The model table a replica's front owns: its own model, the other models of its deployment, each LoRA adapter's
base model, the /v1/models cards, and the adapters its own engine may load.

Adapters loaded at run time (lora/runtime.py) change it only through `learn` and `forget`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence

from deployments.lora.adapters import Adapters


class ModelTable:
    def __init__(
        self,
        model: str,
        models: Sequence[str],
        cards: dict[str, dict] | None = None,
        base_of: dict[str, str] | None = None,
        adapters: Adapters | None = None,
        model_ready: Callable[[str], Awaitable[bool]] | None = None,
    ):
        """`model`: this replica's; `models`: every model of its deployment; `cards`: their /v1/models entries (this
        replica's own comes from vLLM); `base_of`: each adapter's model; `adapters`: this replica's (loaded on first
        use); `model_ready(name)`: whether another model has a replica that can answer now (None: all are listed)."""
        self.model = model
        self.models = list(models)
        self.cards = dict(cards or {})
        self.base_of = dict(base_of or {})
        self.adapters = adapters
        self._model_ready = model_ready

    def names(self) -> list[str]:
        """Every name a request may give as `model`: the models, then the adapters."""
        return self.models + list(self.base_of)

    def base(self, name: str) -> str:
        return self.base_of.get(name, name)

    def serves(self, name: str) -> bool:
        """Whether this replica's engine serves `name` (its model, or one of its model's adapters)."""
        return self.base(name) == self.model

    def taken(self) -> set[str]:
        return {*self.models, *self.base_of}

    def learn(self, name: str, base: str, path: str, engine_path: str | None = None) -> None:
        """An adapter loaded at run time: listed and routed from now on; this replica's engine may load it when it is
        of its model (`engine_path`: the path on this node)."""
        self.base_of[name] = base
        self.cards[name] = {"id": name, "object": "model", "owned_by": "summit", "root": path, "parent": base}
        if base == self.model and self.adapters is not None:
            self.adapters.paths[name] = engine_path or path

    async def forget(self, name: str) -> None:
        self.base_of.pop(name, None)
        self.cards.pop(name, None)
        if self.adapters is not None:
            await self.adapters.forget(name)

    async def listing(self, vllm_answer: tuple[int, bytes] | None) -> dict:
        """/v1/models: vLLM's own entry for this replica's model (max_model_len, root) from its answer, then the
        deployment's other models that can answer now, then the adapters of the models listed."""
        own: list[dict] = []
        if vllm_answer is not None and vllm_answer[0] == 200:  # vLLM's lists the adapters loaded here: not those
            own = [m for m in json.loads(vllm_answer[1])["data"] if m.get("id") == self.model]
        others = [m for m in self.models if m != self.model]
        if self._model_ready is not None:  # a model is listed once one of its replicas has started (and warmed up)
            ready = await asyncio.gather(*(self._model_ready(m) for m in others))
            others = [m for m, ok in zip(others, ready) if ok]
        listed = {self.model, *others}
        others += [a for a, base in self.base_of.items() if base in listed]
        data = own + [self.cards.get(m, {"id": m, "object": "model", "owned_by": "summit"}) for m in others]
        return {"object": "list", "data": data}
