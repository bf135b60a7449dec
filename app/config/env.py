"""`$VAR`, `${VAR}` and `${VAR:-default}` in the YAML's paths, expanded where they are used."""

from __future__ import annotations

import os
import re

_ENV_REF = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand_env(value: str, env: dict[str, str] | None = None) -> str:
    """Expand `$VAR`, `${VAR}` and `${VAR:-default}`, then `~`. An unset variable without default is an error."""
    env = os.environ if env is None else env

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        raise ValueError(
            f"environment variable {name} is not set (give it in runtime_env.env_vars or use ${{{name}:-default}})"
        )

    return os.path.expanduser(_ENV_REF.sub(sub, value))


# engine settings put over every model's `engine_kwargs` as the app is built: a JSON object in the environment of
# the Ray cluster (`ray start`) or the application's runtime_env.env_vars, e.g. '{"load_format": "dummy"}' to try a
# shipped file with random weights of the real shapes, without editing it
ENGINE_OVERRIDES_ENV = "SUMMIT_ENGINE_KWARGS"


def with_engine_overrides(args: dict, env: dict[str, str] | None = None) -> dict:
    """`args` (a YAML's application args) with SUMMIT_ENGINE_KWARGS over each model's engine_kwargs."""
    import json

    env = os.environ if env is None else env
    given = env.get(ENGINE_OVERRIDES_ENV, "").strip()
    if not given:
        return args
    try:
        overrides = json.loads(given)
    except ValueError as e:
        raise ValueError(
            f'{ENGINE_OVERRIDES_ENV} is not JSON ({e}). Fix: a JSON object, e.g. \'{{"load_format": "dummy"}}\''
        ) from None
    if not isinstance(overrides, dict):
        raise ValueError(f"{ENGINE_OVERRIDES_ENV} must be a JSON object of engine_kwargs, got {given!r}")
    models = [
        {**m, "engine_kwargs": {**(m.get("engine_kwargs") or {}), **overrides}} if isinstance(m, dict) else m
        for m in args.get("models") or []
    ]
    return {**args, "models": models}
