"""LoRA adapters, loaded into a running engine's OpenAI app (deployments/lora/adapters.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deployments.engine.app import EngineApp


def _lora_requests():
    try:  # vLLM >= 0.27
        from vllm.entrypoints.serve.lora.protocol import (
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        )
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.protocol import (
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        )
    return LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


async def load_adapter(engine_app: EngineApp, name: str, path: str, base_model: str) -> str | None:
    """Load a LoRA adapter into the engine and make `name` a model of vLLM's OpenAI app (vLLM's own
    /v1/load_lora_adapter, called in-process); the error message, or None once loaded."""
    load, _ = _lora_requests()
    result = await engine_app.app.state.openai_serving_models.load_lora_adapter(
        load(lora_name=name, lora_path=path), base_model_name=base_model
    )
    if isinstance(result, str):
        return None
    error = getattr(result, "error", result)
    return getattr(error, "message", None) or str(error)


async def unload_adapter(engine_app: EngineApp, name: str) -> None:
    """Forget `name` in vLLM's OpenAI app and drop its weights from the engine (vLLM's endpoint does only the first)."""
    _, unload = _lora_requests()
    models = engine_app.app.state.openai_serving_models
    known = models.lora_requests.get(name)
    await models.unload_lora_adapter(unload(lora_name=name))
    if known is not None:
        await engine_app.engine.remove_lora(known.lora_int_id)


async def adapters_in_engine(engine_app: EngineApp) -> dict[str, list[str]]:
    """The engine's own view of the adapters: `registered`, the names vLLM's OpenAI app serves; `in_engine`, those
    whose weights the engine holds now (its LoRA cache, `list_loras`)."""
    models = engine_app.app.state.openai_serving_models
    ids = set(await engine_app.engine.list_loras())
    return {
        "registered": sorted(models.lora_requests),
        "in_engine": sorted(name for name, req in models.lora_requests.items() if req.lora_int_id in ids),
    }
