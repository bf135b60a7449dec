import os

# Tests run on loopback with auth off, whatever the developer's shell says (see FACTS: token auth turns itself on).
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


import openai  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def client(summit) -> openai.OpenAI:
    """The official client against the `summit` fixture of the suite (tests/cpu or tests/gpu)."""
    return openai.OpenAI(base_url=summit.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(summit) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=summit.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
