"""Helpers of the dashboard tests: a real uvicorn server (in a thread, free loopback port)
around an engine on the session's tiny Llama, its core in-process or in its own process (the
`engine` fixture runs each test both ways: the dashboard reads the core through utility calls)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server.app import create_app
from pagedkv.server.graceful import bind_socket

CORE_MODES = ["inproc", "process"]


def make_engine(tiny_llama, core_process: bool = False, **kwargs) -> LLMEngine:
    args = dict(model=str(tiny_llama), dtype="float32", block_size=4, max_model_len=256,
                num_gpu_blocks_override=160, seed=0)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args), core_process=core_process)


@pytest.fixture(params=CORE_MODES)
def engine(request, tiny_llama) -> LLMEngine:
    engine = make_engine(tiny_llama, core_process=request.param == "process", swap_space=0.001)
    yield engine
    engine.shutdown()


@pytest.fixture
def inproc_engine(tiny_llama) -> LLMEngine:
    """For tests whose subject does not read the core (static pages, the API key check)."""
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


def fresh_snapshot(url: str, **headers: str) -> dict:
    """The snapshot a newly connected dashboard gets (the core's own pool state now), and the
    first update after it; the stream is closed again."""
    with httpx.stream("GET", url + "/dashboard/events", timeout=60, headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        events = sse_events(resp)
        name, snap = next(events)
        assert name == "snapshot"
        name, update = next(events)
        assert name == "update"
    return {**snap, "first_update": update}


def wait_until_unwatched(url: str, timeout: float = 10.0) -> None:
    """Wait until the feed has no subscriber but the probe itself (a closed stream's
    unsubscribe runs asynchronously)."""
    deadline = time.monotonic() + timeout
    while fresh_snapshot(url)["subscribers"] != 1:
        assert time.monotonic() < deadline, "a closed dashboard stream is still subscribed"
        time.sleep(0.05)
