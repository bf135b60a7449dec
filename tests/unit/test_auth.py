"""API keys: loading from the YAML's source, constant-time check, OpenAI-shaped 401 without the key."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.config import SummitConfig
from deployments.pipeline.auth import authorized, load_api_keys, unauthorized

MODEL = {"name": "m", "source": "/m", "accelerator": "cpu"}


def test_keys_from_an_env_var_or_a_file(tmp_path):
    assert load_api_keys("KEYS", None, {"KEYS": "k1, k2"}) == [b"k1", b"k2"]
    secret = tmp_path / "keys"
    secret.write_text("k3\n\nk4\n")
    assert load_api_keys(None, str(secret)) == [b"k3", b"k4"]


@pytest.mark.parametrize(
    "env_var, file, env, words",
    [
        ("KEYS", None, {}, ["auth.api_keys_env", "KEYS is not set"]),
        ("KEYS", None, {"KEYS": " , "}, ["auth.api_keys_env", "no key"]),
        (None, "/nonexistent/keys", {}, ["auth.api_keys_file", "cannot read"]),
    ],
)
def test_a_missing_or_empty_key_source_is_named(env_var, file, env, words):
    with pytest.raises(ValueError) as e:
        load_api_keys(env_var, file, env)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_only_a_bearer_with_a_known_key_passes():
    keys = [b"secret-1", b"secret-2"]
    assert authorized("Bearer secret-2", keys) and authorized("bearer secret-1", keys)
    for header in [None, "", "Bearer", "Bearer wrong", "Basic secret-1", "secret-1", "Bearer secret-1x"]:
        assert not authorized(header, keys), header


def test_401_is_openai_shaped_and_never_echoes_the_key():
    response = unauthorized("Bearer not-the-key").response()
    body = json.loads(response.body)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert body["error"]["type"] == "AuthenticationError" and body["error"]["code"] == 401
    assert "not-the-key" not in response.body.decode()
    assert "Missing" in json.loads(unauthorized(None).response().body)["error"]["message"]


def test_auth_config_needs_exactly_one_source():
    assert SummitConfig.model_validate({"models": [MODEL], "auth": {"api_keys_env": "K"}}).auth.api_keys_env == "K"
    for bad in [{}, {"api_keys_env": "K", "api_keys_file": "/f"}, {"api_keys": "inline"}]:
        with pytest.raises(ValidationError) as e:
            SummitConfig.model_validate({"models": [MODEL], "auth": bad})
        assert "auth" in str(e.value) or "api_keys" in str(e.value)
