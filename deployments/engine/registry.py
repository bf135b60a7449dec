"""What the installed vLLM accepts, read from its own registries (not a list of Summit's): the model architectures it
serves and the quantization methods it takes. `summit validate` asks these before a job is submitted; the engine
answers the same at its start (deployments/engine/failure.py names its refusal)."""

from __future__ import annotations


def supported_architectures() -> set[str]:
    """vLLM's model registry (the `architectures` of a config.json it can serve)."""
    from vllm.model_executor.models import ModelRegistry

    return set(ModelRegistry.get_supported_archs())


def architecture_problem(architectures: list[str]) -> str | None:
    """Why the installed vLLM would refuse a config.json's `architectures`, or None."""
    if not architectures:
        return "config.json names no `architectures`"
    known = supported_architectures()
    if any(a in known for a in architectures):
        return None
    return f"architectures {architectures} are not in the installed vLLM's model registry ({len(known)} known)"


def quantization_problem(method: str | None, allow_deprecated: bool) -> str | None:
    """Why the installed vLLM would refuse quantization `method` (the YAML's or the checkpoint's), or None."""
    if not method:
        return None
    from vllm.model_executor.layers.quantization import DEPRECATED_QUANTIZATION_METHODS, QUANTIZATION_METHODS

    if method not in QUANTIZATION_METHODS:
        return f"quantization {method!r} is not a method of the installed vLLM"
    if method in DEPRECATED_QUANTIZATION_METHODS and not allow_deprecated:
        return (
            f"quantization {method!r} is deprecated in the installed vLLM, which refuses it unless "
            "engine_kwargs.allow_deprecated_quantization is true"
        )
    return None
