"""Checks of a model's vLLM options before anything starts, each error naming the YAML key and the fix: the
schema's `EngineChecks` (app/config/checks.py) answered by the installed vLLM, through `deployments.engine`.

`load_config` validates a YAML's `args:` with them; every place that validates a YAML for real uses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from app.config import SummitConfig
from app.config.env import with_engine_overrides
from deployments import engine


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming the first engine kwarg that vLLM does not know or whose value has the wrong type."""
    types = engine.engine_arg_types()
    for key, value in kwargs.items():
        if key in engine.RESERVED_ENGINE_KEYS:
            raise ValueError(
                f"engine_kwargs.{key}: set it with the model's `{engine.RESERVED_ENGINE_KEYS[key]}` key instead"
            )
        if key not in types:
            close = [k for k in types if key.replace("-", "_") == k or key in k or k in key][:5]
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"engine_kwargs.{key} is not a vLLM engine argument{hint}")
        hint = types[key]
        if hint is None:
            continue
        try:
            adapter = TypeAdapter(hint)
        except Exception:  # annotations pydantic cannot build a schema for: leave them to vLLM
            continue
        try:
            adapter.validate_python(value)
        except ValidationError as e:
            raise ValueError(
                f"engine_kwargs.{key}={value!r} has the wrong type for vLLM ({e.errors()[0]['msg']})"
            ) from None


SUMMIT_DIR = Path(__file__).resolve().parents[2]


def resolve_chat_template(frontend_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A `chat_template` given as a relative .jinja path is found in the working directory or in Summit's own
    (`serve_configs/templates/...` works wherever the replica runs) and handed to vLLM as an absolute path."""
    template = frontend_kwargs.get("chat_template")
    if not isinstance(template, str) or not template.endswith(".jinja") or Path(template).is_absolute():
        return frontend_kwargs
    for base in (Path.cwd(), SUMMIT_DIR):
        if (base / template).is_file():
            return {**frontend_kwargs, "chat_template": str((base / template).resolve())}
    raise ValueError(
        f"frontend_kwargs.chat_template {template!r}: no such file in the working directory or in "
        f"Summit's directory ({SUMMIT_DIR}); give an absolute path"
    )


def check_tool_options(frontend_kwargs: dict[str, Any]) -> None:
    """Tool calling: a parser vLLM has (unless a plugin brings its own), and automatic tool choice only with one."""
    parser = frontend_kwargs.get("tool_call_parser")
    if frontend_kwargs.get("enable_auto_tool_choice") and not parser:
        raise ValueError(
            "frontend_kwargs.enable_auto_tool_choice needs frontend_kwargs.tool_call_parser "
            "(llama3_json for Llama 3.1, hermes for Qwen, mistral for Mistral)"
        )
    if parser and not frontend_kwargs.get("tool_parser_plugin"):
        names = engine.tool_parser_names()
        if parser not in names:
            raise ValueError(
                f"frontend_kwargs.tool_call_parser {parser!r} is not one of vLLM's tool parsers: "
                f"{', '.join(names)} (or give frontend_kwargs.tool_parser_plugin)"
            )


def check_frontend_kwargs(frontend_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Options of vLLM's OpenAI server only, tool options that go together; a relative chat_template resolved."""
    known = engine.frontend_arg_names()
    for key in frontend_kwargs:
        if key not in known:
            raise ValueError(
                f"frontend_kwargs.{key} is not an option of vLLM's OpenAI server; known: {', '.join(sorted(known))}"
            )
    check_tool_options(frontend_kwargs)
    return resolve_chat_template(frontend_kwargs)


def check_cpu_quantization(model: str, engine_kwargs: dict[str, Any]) -> None:
    """A CPU engine takes only the quantization methods this vLLM runs on a CPU
    (measured: scripts/cpu_quantization.py)."""
    method = engine_kwargs.get("quantization")
    if not method:
        return
    if method not in engine.CPU_QUANTIZATION:
        raise ValueError(
            f"model {model!r}: engine_kwargs.quantization {method!r} does not run on CPU engines "
            f"(accelerator: cpu); methods that do: {', '.join(engine.CPU_QUANTIZATION)}. Use one of them, "
            "or serve the model on GPUs (accelerator: gpu)"
        )


class VllmChecks:
    """The schema's EngineChecks over the installed vLLM."""

    check_engine_kwargs = staticmethod(check_engine_kwargs)
    check_frontend_kwargs = staticmethod(check_frontend_kwargs)
    check_cpu_quantization = staticmethod(check_cpu_quantization)
    check_gpu_engine_kwargs = staticmethod(engine.check_gpu_engine_kwargs)

    @staticmethod
    def check_kv_connector(name: str) -> None:
        engine.kv_connector(name)  # raises naming the known ones


# The validation context that turns the schema's engine checks on.
ENGINE_CONTEXT = {"engine": VllmChecks()}


def load_config(args: dict[str, Any]) -> SummitConfig:
    """A YAML's `args:` validated as the app is built: the schema and the installed vLLM's checks, with the engine
    settings of SUMMIT_ENGINE_KWARGS over every model's (app/config/env.py)."""
    return SummitConfig.model_validate(with_engine_overrides(args), context=ENGINE_CONTEXT)
