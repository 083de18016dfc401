"""pagedkv/bench/placement.py: client results joined to backends' request-log rows, and the load
each request met on its own backend and on the others."""

from __future__ import annotations

import json

import pytest

from pagedkv.bench.metrics import RequestResult
from pagedkv.bench.placement import (
    join_records,
    read_request_log,
    summarize,
    write_records,
)


def row(request_id: str, arrival: float, ttft: float, e2e: float, prompt: int,
        cached: int) -> dict:
    return {"request_id": request_id, "arrival": arrival, "ttft": ttft, "e2e": e2e,
            "prompt_tokens": prompt, "cached_tokens": cached, "queue_time": 0.0}


def test_records_count_the_load_each_request_met():
    results = [RequestResult(success=True, ttft=0.5, response_id="cmpl-a"),
               RequestResult(success=True, ttft=0.3, response_id="cmpl-b"),
               RequestResult(success=True, ttft=0.2, response_id="cmpl-c"),
               RequestResult(success=False, error="HTTP 503")]
    logs = [
        # backend 0: a (100 s, first token at 100.4, done at 101), then c at 100.2
        [row("cmpl-a-0", 100.0, 0.4, 1.0, 640, 64), row("cmpl-c-0", 100.2, 0.15, 0.5, 96, 0)],
        # backend 1: b at 100.1, still prefilling at 100.2
        [row("cmpl-b-0", 100.1, 0.25, 0.6, 320, 32)],
    ]
    records = join_records(results, logs)
    assert [(r.index, r.backend) for r in records] == [(0, 0), (1, 1), (2, 0)]
    a, b, c = records
    assert a.arrival == 0.0 and b.arrival == pytest.approx(0.1) and c.arrival == pytest.approx(0.2)
    assert (a.queued_here, a.running_here, a.queued_elsewhere) == (0, 0, 0)
    # b met a prefilling on the other backend: 640 - 64 tokens still to compute.
    assert (b.queued_here, b.queued_elsewhere, b.queued_tokens_elsewhere) == (0, 1, 576)
    # c met a still prefilling on its own backend, b prefilling on the other.
    assert (c.running_here, c.queued_here, c.queued_tokens_here) == (1, 1, 576)
    assert (c.queued_elsewhere, c.queued_tokens_elsewhere) == (1, 288)
    assert c.ttft_client == pytest.approx(0.2) and c.ttft_server == pytest.approx(0.15)
    assert c.new_tokens == 96
    lines = summarize(records, 2)
    assert lines[0] == "  backend 0: n=2 TTFT mean 275 p99 398 ms, new tokens 336"
    assert any(line.startswith("  work queued here (placement): n=1 TTFT mean 150")
               for line in lines)
    assert any(line.startswith("  nothing queued here, prefills elsewhere (contention): n=1 "
                               "TTFT mean 250") for line in lines)


def test_unknown_ids_and_unfinished_rows(tmp_path):
    logs = [[row("cmpl-x-0", 5.0, 0.1, 0.2, 64, 0), {**row("cmpl-y-0", 5.0, 0.1, 0.2, 64, 0),
                                                      "ttft": None}]]
    records = join_records([], logs)
    assert [(r.index, r.ttft_client) for r in records] == [(-1, None)]  # no ttft: dropped
    assert join_records([], [[], []]) == []
    assert summarize([], 2) == ["no request-log records"]
    path = tmp_path / "records.jsonl"
    write_records(path, records)
    assert json.loads(path.read_text())["ttft_server"] == pytest.approx(0.1)
    assert read_request_log(tmp_path / "missing.jsonl") == []
    (tmp_path / "log.jsonl").write_text(json.dumps(logs[0][0]) + "\n\n")
    assert read_request_log(tmp_path / "log.jsonl") == [logs[0][0]]
