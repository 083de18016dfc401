"""Fault injection in-process: a model step that raises (through the runner) ends only its
requests (500, or an error event and [DONE]) and the server keeps answering; a step that raises
elsewhere fails what is in flight and the loop goes on; a loop that cannot go on (broken pool
invariants) stops and tells `on_engine_dead`, and `pagedkv serve`'s server then exits."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from pagedkv.config.errors import ErrorKind
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.server.app import create_app
from pagedkv.server.graceful import DrainingServer, bind_socket
from pagedkv.server.serving import failure
from tests.engine.conftest import hf_greedy

POISON = 399  # a prompt starting with this token makes the runner raise


@pytest.fixture
def engine(tiny_llama) -> LLMEngine:
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=256, num_gpu_blocks_override=128))
    real_execute = engine.runner.execute

    def execute(out):
        if any(r.prompt_token_ids[:1] == [POISON] for r in out.scheduled):
            raise RuntimeError("injected runner fault")
        return real_execute(out)

    engine.runner.execute = execute
    return engine


def assert_pool_empty(engine: LLMEngine) -> None:
    engine.check_invariants()
    kv = engine.scheduler.kv_cache_manager
    assert kv.pool.get_num_free_blocks() == kv.num_usable_blocks
    assert not engine.has_unfinished_requests()


def test_runner_fault_ends_its_request_and_the_server_keeps_answering(engine, tiny_llama):
    good = [1, 20, 30, 40]
    body = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with TestClient(create_app(engine, served_model_name="m")) as client:
        bad = client.post("/v1/completions", json={"prompt": [POISON, 5, 6], **body})
        assert bad.status_code == 500
        error = bad.json()["error"]
        assert error["type"] == "internal_server_error" and "injected runner fault" in error["message"]
        with client.stream("POST", "/v1/completions",
                           json={"prompt": [POISON, 7], "stream": True, **body}) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "injected runner fault" in json.loads(events[-2][6:])["error"]["message"]
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/completions", json={"prompt": good, **body})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
    assert_pool_empty(engine)
    # The surviving engine still computes the right thing.
    engine.add_request("after", {"prompt_token_ids": good},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == hf_greedy(tiny_llama, good, 6)


def test_the_status_of_a_failed_request_follows_its_error_kind_not_its_text():
    """A model step's failure is the server's (500), a request that can never run the
    client's (400), whatever the message says."""
    def ended(error: str, kind: ErrorKind) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, "", [], finish_reason="error")],
                             finished=True, error=error, error_kind=kind)

    internal = failure(ended("worded like a bad request", ErrorKind.INTERNAL))
    assert (internal.status_code, internal.type) == (500, "internal_server_error")
    invalid = failure(ended("internal error: the model step failed: (a prompt)", ErrorKind.INVALID))
    assert (invalid.status_code, invalid.param) == (400, "prompt")


def test_a_step_that_raises_elsewhere_fails_what_is_in_flight_and_goes_on(engine):
    real_schedule = engine.scheduler.schedule
    calls = [0]

    def schedule():
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected scheduler fault")
        return real_schedule()

    engine.scheduler.schedule = schedule
    with TestClient(create_app(engine, served_model_name="m")) as client:
        first = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert first.status_code == 500
        assert "injected scheduler fault" in first.json()["error"]["message"]
        second = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3,
                                                       "ignore_eos": True})
        assert second.status_code == 200 and second.json()["usage"]["completion_tokens"] == 3
        assert client.get("/health").status_code == 200
    assert_pool_empty(engine)


def test_broken_invariants_stop_the_loop_and_call_on_engine_dead(engine):
    reasons: list[str] = []
    dead = threading.Event()

    def on_dead(reason: str) -> None:
        reasons.append(reason)
        dead.set()

    def broken() -> None:
        raise RuntimeError("injected invariant break")

    engine.check_invariants = broken
    app = create_app(engine, served_model_name="m", on_engine_dead=on_dead)
    with TestClient(app) as client:
        ok = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2,
                                                   "ignore_eos": True})
        assert ok.status_code == 200  # answered; the check runs when the engine falls idle
        assert dead.wait(30)
        assert "injected invariant break" in reasons[0]
        health = client.get("/health")
        assert health.status_code == 503 and "invariant" in health.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 503


def test_serve_stops_with_a_reason_when_the_engine_dies(engine):
    """The server `pagedkv serve` runs: once the loop dies it shuts down by itself (exit_reason
    set, so the command exits 1) instead of answering 503 for ever."""
    def broken() -> None:
        raise RuntimeError("injected invariant break")

    engine.check_invariants = broken
    holder: dict[str, DrainingServer] = {}
    app = create_app(engine, served_model_name="m",
                     on_engine_dead=lambda reason: holder["server"].stop_for_dead_engine(reason))
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = holder["server"] = DrainingServer(uvicorn.Config(app, log_level="warning"),
                                               app.state.async_engine, shutdown_timeout=1.0)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            thread.join(0.05)
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                          json={"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
        assert resp.status_code == 200
        thread.join(30)
        assert not thread.is_alive(), "the server kept running after the engine died"
        assert server.exit_reason is not None and "injected invariant break" in server.exit_reason
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
