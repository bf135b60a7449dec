"""API keys (`Authorization: Bearer KEY`), checked at the HTTP entry: keys from an environment variable or a file
named in the YAML's `auth:`, compared in constant time, never logged or echoed."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from deployments.http.errors import OpenAIError


def load_api_keys(env_var: str | None, file: str | None, env: dict[str, str] | None = None) -> list[bytes]:
    """The keys (comma- or newline-separated) from `env_var` or `file`; raises ValueError naming the YAML key."""
    env = os.environ if env is None else env
    if env_var is not None:
        if not env.get(env_var):
            raise ValueError(
                f"auth.api_keys_env: environment variable {env_var} is not set or empty; set it where the "
                "app runs (the cluster's environment or runtime_env.env_vars)"
            )
        text, where = env[env_var], f"auth.api_keys_env ({env_var})"
    else:
        path = Path(os.path.expanduser(file))
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(
                f"auth.api_keys_file: cannot read {path} ({e.strerror}); give a readable file, one key a line"
            ) from None
        where = f"auth.api_keys_file ({path})"
    keys = [k.strip().encode() for k in text.replace(",", "\n").splitlines() if k.strip()]
    if not keys:
        raise ValueError(f"{where} holds no key")
    return keys


def authorized(authorization: str | None, keys: list[bytes]) -> bool:
    """Whether an `Authorization` header carries one of `keys` (every key compared, in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    given_bytes = given.strip().encode()
    return any([hmac.compare_digest(given_bytes, key) for key in keys])  # a list: no short cut on the first match


def unauthorized(authorization: str | None) -> OpenAIError:
    """OpenAI's 401, without the key that was sent."""
    message = (
        "Missing API key: send `Authorization: Bearer <key>`." if not authorization else "Incorrect API key provided."
    )
    return OpenAIError(401, message, headers={"www-authenticate": "Bearer"})


def owner_of(authorization: bytes | None) -> bytes:
    """The owner of the files and batches a caller makes: a hash of its API key (never the key itself)."""
    token = (authorization or b"").removeprefix(b"Bearer ").strip()
    return hashlib.sha256(token).hexdigest()[:24].encode()
