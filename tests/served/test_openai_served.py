"""The GPU suite's OpenAI checks (tests/openai_checks.py) against the server at SUMMIT_SERVED_URL (conftest.py)."""

from __future__ import annotations

import os

import pytest

from tests.openai_checks import *  # noqa: F403 - collected here with this directory's fixtures
from tests.served.conftest import URL_ENV

pytestmark = pytest.mark.skipif(not os.environ.get(URL_ENV), reason=f"no running server named ({URL_ENV})")
