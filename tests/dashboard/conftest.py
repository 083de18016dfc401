"""Helpers of the dashboard tests: a real uvicorn server (in a thread, free loopback port)
around an in-process engine on the session's tiny Llama."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server.app import create_app
from pagedkv.server.graceful import bind_socket


def make_engine(tiny_llama, **kwargs) -> LLMEngine:
    args = dict(model=str(tiny_llama), dtype="float32", block_size=4, max_model_len=256,
                num_gpu_blocks_override=160, seed=0)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


@pytest.fixture
def engine(tiny_llama) -> LLMEngine:
    engine = make_engine(tiny_llama, swap_space=0.001)
    yield engine
    engine.shutdown()


@contextmanager
def serving(engine: LLMEngine, **app_kwargs) -> Iterator[str]:
    """`create_app(engine)` under uvicorn in a thread; yields its base URL."""
    app = create_app(engine, served_model_name="tiny", **app_kwargs)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])),
                              daemon=True)
    thread.start()
    try:
        for _ in range(400):
            if server.started:
                break
            thread.join(0.05)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def sse_events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """(event name, JSON data) of a text/event-stream response, as they arrive."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = None
