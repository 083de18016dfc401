"""`pagedkv serve --request-log`: one JSON line per finished request, readable as a trace by
`pagedkv simulate` with the prefix sharing the engine saw."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedkv.kv.hashing import RequestBlockHasher
from pagedkv.sim.traces import load_trace, prompt_token_ids
from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags


def test_request_log_is_a_replayable_trace(tiny_llama, tmp_path):
    log = tmp_path / "requests.jsonl"
    proc = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS),
                         "--request-log", str(log)).start()
    shared = list(range(10, 42))  # 8 full blocks of 4 tokens
    prompts = [shared + [5, 6, 7], shared + [8, 9], list(range(100, 111))]
    try:
        for prompt in prompts:
            r = httpx.post(proc.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                "temperature": 0})
            assert r.status_code == 200, r.text
    finally:
        assert proc.stop()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 3
    hasher = RequestBlockHasher("sha256", 4)

    class P:
        cache_salt = None
        lora_name = None

    for row, prompt in zip(rows, prompts, strict=True):
        P.all_token_ids = prompt
        assert row["prompt_tokens"] == len(prompt) and row["output_tokens"] == 6
        assert row["block_size"] == 4 and row["finish_reason"] == "length"
        assert row["prefix_block_hashes"] == [h.hex() for h in hasher(P, [])]
        assert 0 <= row["queue_time"] <= row["ttft"] <= row["e2e"] and row["tpot"] > 0
        # the request's timeline, from the handler's start: queued for the engine loop, taken
        # by it, scheduled, its first token made by the engine, then seen by the server
        assert 0 <= row["submitted"] <= row["added"] <= row["first_scheduled"] \
            <= row["engine_first_token"] <= row["ttft"]
        assert row["engine_first_token"] < row["engine_last_token"] <= row["e2e"]
        assert row["first_scheduled"] - row["added"] == pytest.approx(row["queue_time"])
        assert row["request_id"].startswith("cmpl-") and row["request_id"].endswith("-0")
    assert rows[0]["cached_tokens"] == 0 and rows[1]["cached_tokens"] == 32
    assert rows[0]["arrival"] < rows[1]["arrival"] < rows[2]["arrival"]

    trace = load_trace(log)  # format sniffed
    assert [t.input_length for t in trace] == [35, 34, 11]
    assert trace[0].arrival == 0.0 and trace[0].block_tokens == 4
    assert trace[0].block_ids[:8] == trace[1].block_ids[:8]
    assert not set(trace[2].block_ids) & set(trace[0].block_ids)
    ids = [prompt_token_ids(t, 640, i) for i, t in enumerate(trace)]
    assert ids[0][:32] == ids[1][:32] and ids[0][32:] != ids[1][32:34]
