"""The OpenAI checks against a server that is already running (a shipped config deployed on a GPU host, or any
OpenAI server): SUMMIT_SERVED_URL (e.g. http://127.0.0.1:8000) and SUMMIT_SERVED_MODEL (default: the one model it
lists). Skipped without SUMMIT_SERVED_URL. bench/flagship.py runs them after `serve deploy`."""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
import pytest

URL_ENV, MODEL_ENV = "SUMMIT_SERVED_URL", "SUMMIT_SERVED_MODEL"


def pytest_report_header(config):
    url = os.environ.get(URL_ENV)
    return f"served checks: {url}" if url else f"served checks: skipped ({URL_ENV} not set)"


@pytest.fixture(scope="session")
def served() -> SimpleNamespace:
    url = os.environ[URL_ENV].rstrip("/")
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    name = os.environ.get(MODEL_ENV) or (models[0]["id"] if len(models) == 1 else None)
    if name is None:
        pytest.fail(f"{url} serves {[m['id'] for m in models]}: name one in {MODEL_ENV}")
    (model,) = [m for m in models if m["id"] == name]
    return SimpleNamespace(base_url=url, model=name, max_model_len=model["max_model_len"])


@pytest.fixture
def summit(served) -> SimpleNamespace:
    return served


@pytest.fixture(autouse=True)
def served_model(served, monkeypatch):
    """The checks name the CPU suite's model and context length (module constants): the served ones instead."""
    import tests.cpu.test_errors
    import tests.cpu.test_openai_api

    for module in (tests.cpu.test_errors, tests.cpu.test_openai_api):
        monkeypatch.setattr(module, "MODEL", served.model)
    monkeypatch.setattr(tests.cpu.test_errors, "MAX_MODEL_LEN", served.max_model_len)
