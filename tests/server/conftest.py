"""Fixtures of the server tests: the main `pagedkv serve` process, on the session's tiny
random-weight Llama (tests/conftest.py). test_limits.py starts its own, differently configured.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags, wait_for_idle_pool


@pytest.fixture(scope="session")
def server(tiny_llama: Path):
    """The main server: the tiny Llama with ENGINE_KWARGS, no API key. Session-scoped (one per
    xdist worker): the modules that share it leave it idle after each test.

    Teardown: /health still answers 200 (the loop checks the block pool's invariants each time
    the engine falls idle and reports a failure there), nothing runs, no block is held, and
    SIGTERM stops it with exit code 0.
    """
    proc = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS)).start()
    try:
        yield proc
        metrics = wait_for_idle_pool(proc.url)
        health = httpx.get(proc.url + "/health", timeout=10)
        assert health.status_code == 200, health.text
        assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0
        assert metrics["pagedkv:num_requests_running"] == 0
    finally:
        clean = proc.stop()
    assert clean, "server did not shut down cleanly"


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    """The official openai client on the main server (no retries: a failure shows at once)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
