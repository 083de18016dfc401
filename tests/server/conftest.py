"""Fixtures of the server tests: the openai client of the main `pagedkv serve` process (the
session's `server`, tests/conftest.py, which the router's end-to-end tests share).
test_limits.py starts its own, differently configured.
"""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    """The official openai client on the main server (no retries: a failure shows at once)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
