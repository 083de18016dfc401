"""/health reports a wedged engine loop (issue 20): a step that never returns leaves the loop
thread alive, so liveness alone says nothing. While one step has run longer than the stall
timeout /health answers 503; once the step returns it answers 200 again. The wedge is a
blocked runner in-process, and, with the engine core in its own process, a stopped core."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server.app import create_app

WEDGE = 398  # a prompt starting with this token blocks the runner until released
# The stall timeout: long enough that a loaded machine answers the "step in progress, not yet
# wedged" check within it, short enough to keep the test quick.
STALL_S = 2.0


@pytest.mark.timeout(120, method="thread")
def test_health_is_503_while_a_step_is_wedged_and_200_after(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=256, num_gpu_blocks_override=64))
    release, entered = threading.Event(), threading.Event()
    real_execute = engine.runner.execute

    def execute(out):
        if any(r.prompt_token_ids[:1] == [WEDGE] for r in out.scheduled):
            entered.set()
            assert release.wait(30), "the test never released the wedged step"
        return real_execute(out)

    engine.runner.execute = execute
    app = create_app(engine, served_model_name="m", stall_timeout_s=STALL_S)
    body = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        answers: list = []
        worker = threading.Thread(target=lambda: answers.append(
            client.post("/v1/completions", json={"prompt": [WEDGE, 5, 6], **body})))
        worker.start()
        try:
            assert entered.wait(30)
            assert client.get("/health").status_code == 200  # a step may take a while
            time.sleep(STALL_S + 0.2)  # the step has now run longer than STALL_S
            wedged = client.get("/health")
            assert wedged.status_code == 503
            error = wedged.json()["error"]
            assert error["type"] == "server_unavailable" and "wedged" in error["message"]
            assert client.get("/ping").status_code == 503
        finally:
            release.set()
            worker.join(30)
        assert answers and answers[0].status_code == 200
        assert answers[0].json()["usage"]["completion_tokens"] == 2
        assert client.get("/health").status_code == 200
    engine.check_invariants()
    kv = engine.scheduler.kv_cache_manager
    assert kv.pool.get_num_free_blocks() == kv.num_usable_blocks


def test_stall_timeout_must_be_positive(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=256, num_gpu_blocks_override=64))
    with pytest.raises(ValueError, match="stall_timeout_s"):
        create_app(engine, served_model_name="m", stall_timeout_s=0)


@pytest.mark.timeout(120, method="thread")
def test_health_is_503_while_the_core_process_is_stuck_in_a_step(tiny_llama):
    """With the engine core in its own process the frontend's loop never blocks on a step: the
    core's own step clock shows a step that does not return (here: the core stopped by
    SIGSTOP mid-stream), and /health answers 503 until it goes on."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=1024, num_gpu_blocks_override=300),
                       core_process=True)
    core = engine.client.process
    app = create_app(engine, served_model_name="m", stall_timeout_s=STALL_S)
    # Long enough that the core is still stepping when the first token has arrived.
    body = {"prompt": [1, 5, 6], "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    try:
        with TestClient(app) as client:
            assert client.get("/health").status_code == 200
            with client.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                os.kill(core.pid, signal.SIGSTOP)
                try:
                    time.sleep(STALL_S + 0.3)
                    wedged = client.get("/health")
                    assert wedged.status_code == 503
                    assert "wedged" in wedged.json()["error"]["message"]
                finally:
                    os.kill(core.pid, signal.SIGCONT)
                events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert client.get("/health").status_code == 200
        engine.check_invariants()
        assert engine.get_stats().num_free_blocks == engine.client.ready.num_usable_blocks
    finally:
        engine.shutdown()


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("work", ["request", "utility call"])
def test_health_is_503_when_a_core_frozen_while_idle_leaves_work_untaken(tiny_llama, work):
    """A core stopped (SIGSTOP) while idle runs no step, so no step clock shows it: the work
    sent to it (a request, or the utility call a /metrics scrape makes) is not taken, and
    once that has waited longer than the stall timeout /health answers 503; after SIGCONT the
    core takes it, the request is answered, and /health is 200 again."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=256, num_gpu_blocks_override=64),
                       core_process=True)
    core = engine.client.process
    app = create_app(engine, served_model_name="m", stall_timeout_s=STALL_S)
    body = {"prompt": [1, 5, 6], "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    path, send = ("/v1/completions", body) if work == "request" else ("/metrics", None)
    try:
        with TestClient(app) as client:
            assert client.get("/health").status_code == 200
            os.kill(core.pid, signal.SIGSTOP)
            answers: list = []
            try:
                worker = threading.Thread(target=lambda: answers.append(
                    client.post(path, json=send) if send else client.get(path)))
                worker.start()
                time.sleep(0.5)
                assert client.get("/health").status_code == 200  # not yet past the timeout
                time.sleep(STALL_S)
                frozen = client.get("/health")
                assert frozen.status_code == 503
                assert "wedged" in frozen.json()["error"]["message"]
                assert not answers
            finally:
                os.kill(core.pid, signal.SIGCONT)
            worker.join(30)
            assert answers and answers[0].status_code == 200
            if send:
                assert answers[0].json()["usage"]["completion_tokens"] == 2
            assert client.get("/health").status_code == 200
        engine.check_invariants()
    finally:
        engine.shutdown()
