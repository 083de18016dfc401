"""`--request-log` on a failing disk (issue 43): a write that fails never changes an answer
(every request is answered in full, streams end with [DONE]); the dropped lines are counted in
/metrics and logged at most once a minute, and lines are written again once writes succeed."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.server import request_log
from pagedkv.server.app import create_app
from pagedkv.server.request_log import RequestLog

pytestmark = pytest.mark.timeout(180, method="thread")

BODY = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _failures(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("pagedkv:request_log_write_failures_total "):
            return float(line.split()[-1])
    raise AssertionError("no pagedkv:request_log_write_failures_total in /metrics")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=256, num_gpu_blocks_override=128))
    yield engine
    engine.shutdown()


def _app(engine: LLMEngine, path: str | Path):
    app = create_app(engine, served_model_name="m")
    app.state.serving.request_log = RequestLog(path, engine.block_hasher(),
                                               registry=app.state.metrics.registry)
    return app


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_disk_changes_no_answer_and_is_counted(engine, caplog):
    app = _app(engine, "/dev/full")
    with TestClient(app) as client, caplog.at_level(logging.WARNING, "pagedkv.server"):
        plain = client.post("/v1/completions", json=BODY)
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == 4
        streamed = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=streamed) as resp:
            assert resp.status_code == 200
            events = [line.removeprefix("data: ") for line in resp.iter_lines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert _failures(client) == 2
        assert client.get("/health").status_code == 200
    warnings = [r for r in caplog.records if "--request-log" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: the second failure came within the minute
    assert "No space left on device" in warnings[0].getMessage()
    assert app.state.serving.request_log.write_failures == 2


def test_lines_are_written_again_once_writes_succeed(engine, tmp_path, monkeypatch, caplog):
    path = tmp_path / "requests.jsonl"
    app = _app(engine, path)
    real_write = os.write
    failing = {"left": 2}

    def flaky_write(fd: int, data: bytes) -> int:
        if failing["left"]:
            failing["left"] -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_write(fd, data)

    monkeypatch.setattr(request_log.os, "write", flaky_write)
    with TestClient(app) as client, caplog.at_level(logging.WARNING, "pagedkv.server"):
        for _ in range(3):
            answer = client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert _failures(client) == 2
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["output_tokens"] == 4  # the third request's line
    messages = [r.getMessage() for r in caplog.records if "--request-log" in r.getMessage()]
    assert len(messages) == 2 and "write failed" in messages[0]
    assert "succeed again (2 line(s) dropped" in messages[1]
