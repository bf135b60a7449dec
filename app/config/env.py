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
