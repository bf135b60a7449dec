"""What the schema's validators ask the installed engine, as a protocol: the schema imports no engine.

The control plane validates a YAML with an implementation as pydantic's validation context
(`SummitConfig.model_validate(args, context={"engine": checks})`: `app.build.engine_checks.load_config`); validated
without one (a config handed to a replica, a unit test of pure rules), these checks are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Protocol

from pydantic import AfterValidator, ValidationInfo


class EngineChecks(Protocol):
    """Each check raises ValueError naming the YAML key and the fix."""

    def check_engine_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Every engine kwarg is one of the engine's arguments (not one Summit sets itself), of the right type."""

    def check_frontend_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every frontend kwarg is an option of the engine's OpenAI server, the tool options go together; the kwargs
        with a relative `chat_template` file resolved to an absolute path."""

    def check_kv_connector(self, name: str) -> None:
        """`name` is a KV connector of the installed engine."""

    def check_gpu_engine_kwargs(self, kwargs: dict[str, Any]) -> None:
        """A GPU engine's kwargs would not put NVLink multicast to use."""

    def check_cpu_quantization(self, model: str, kwargs: dict[str, Any]) -> None:
        """A CPU engine's quantization method runs on CPUs."""


def engine_checks(info: ValidationInfo) -> EngineChecks | None:
    """The validation context's "engine", or None when the config is validated without one."""
    context = info.context
    return context.get("engine") if isinstance(context, Mapping) else None


def _known_engine_kwargs(kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
    """vLLM's AsyncEngineArgs fields and types, where the app is built or validated (the validation context)."""
    if (engine := engine_checks(info)) is not None:
        engine.check_engine_kwargs(kwargs)
    return kwargs


EngineKwargs = Annotated[dict[str, Any], AfterValidator(_known_engine_kwargs)]
