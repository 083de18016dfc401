"""No request field lets one client stall the others: every list field is capped (a 400 naming
the limit, before the engine), `allowed_token_ids` is reduced to its distinct ids, bad words are
tokenized in a tokenizer thread (never on the engine loop), and a small request sent beside the
largest accepted lists finishes in bounded time. In-process app, the real tiny engine."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sched.validation import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEXT_LIST_BYTES,
)
from pagedkv.server.app import create_app
from tests.server.helpers import engine_core_process

FAST_S = 5.0  # a refusal takes milliseconds; this bound only catches work that grows with input


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=256, num_gpu_blocks_override=128),
                       core_process=engine_core_process())
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, served_model_name="tiny")) as client:
        yield client


def post(client: TestClient, **fields: object):
    body = {"prompt": "hello", "max_tokens": 2, "ignore_eos": True, **fields}
    started = time.monotonic()
    resp = client.post("/v1/completions", json=body)
    return resp, time.monotonic() - started


HUGE = {
    "bad_words": ([f"w{i}" for i in range(20_000)], MAX_BAD_WORDS),
    "allowed_token_ids": ([5] * 500_000, MAX_ALLOWED_TOKEN_IDS),
    "logit_bias": ({str(i): 1.0 for i in range(5_000)}, MAX_LOGIT_BIAS),
    "stop_token_ids": (list(range(MAX_STOP_TOKEN_IDS + 1)), MAX_STOP_TOKEN_IDS),
    "stop": ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], MAX_STOP_STRINGS),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("field", sorted(HUGE))
def test_a_list_past_its_cap_is_refused_fast_naming_the_limit(client, field):
    value, limit = HUGE[field]
    resp, took = post(client, **{field: value})
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert str(limit) in error["message"] and error["param"] == field, error
    assert len(resp.content) < 2000  # the list is named, never echoed back
    assert took < FAST_S, took


@pytest.mark.timeout(120)
@pytest.mark.parametrize("field", ["bad_words", "stop"])
def test_text_lists_are_capped_in_bytes(client, field):
    words = ["x" * 300] * (MAX_TEXT_LIST_BYTES // 300 + 1)  # few strings, too many bytes
    assert len(words) <= min(MAX_BAD_WORDS, MAX_STOP_STRINGS)
    resp, took = post(client, **{field: words})
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert str(MAX_TEXT_LIST_BYTES) in error["message"] and error["param"] == field, error
    assert took < FAST_S, took


@pytest.mark.timeout(120)
def test_allowed_token_ids_are_reduced_to_distinct_ids(client, engine):
    many = [7] * (MAX_ALLOWED_TOKEN_IDS // 2) + [9] * (MAX_ALLOWED_TOKEN_IDS // 2)
    resp, _ = post(client, allowed_token_ids=many, max_tokens=4, temperature=1.0, seed=3)
    assert resp.status_code == 200, resp.text[:300]
    resp, _ = post(client, allowed_token_ids=many, max_tokens=8, temperature=1.0, seed=3,
                   logprobs=0, return_tokens_as_token_ids=True)
    tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8 and {int(t.split(":")[1]) for t in tokens} <= {7, 9}
    vocab = engine.vocab_size
    resp, _ = post(client, allowed_token_ids=[1, vocab + 4, vocab, 3])
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert f"{vocab}, {vocab + 4}" in message and resp.json()["error"]["param"] == \
        "allowed_token_ids"


@pytest.mark.timeout(120)
def test_stop_token_ids_past_the_vocabulary_are_refused(client, engine):
    vocab = engine.vocab_size
    resp, _ = post(client, stop_token_ids=[2, vocab + 1])
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert str(vocab + 1) in error["message"] and error["param"] == "stop_token_ids", error


@pytest.mark.timeout(120)
def test_bad_words_are_tokenized_off_the_engine_loop(client, engine, monkeypatch):
    seen: list[str] = []
    encode = engine.tokenizer.encode

    def spy(text, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    resp, _ = post(client, prompt=[5, 6, 7], bad_words=["hello", "world"])
    assert resp.status_code == 200, resp.text
    assert len(seen) == 4 and "pagedkv-engine-loop" not in seen, seen


@pytest.mark.timeout(120)
def test_a_small_request_is_not_held_up_by_the_largest_lists(client, engine):
    alone = min(post(client, max_tokens=4)[1] for _ in range(3))
    heavy = {"bad_words": [f"word{i} " * 6 for i in range(MAX_BAD_WORDS)][:MAX_BAD_WORDS],
             "allowed_token_ids": list(range(engine.vocab_size)) * 2,
             "logit_bias": {str(i): 0.5 for i in range(min(MAX_LOGIT_BIAS, engine.vocab_size))},
             "stop": [f"stop{i}" for i in range(MAX_STOP_STRINGS)],
             "max_tokens": 40, "temperature": 1.0, "seed": 1}
    results: list[tuple[int, float]] = []

    def heavy_request() -> None:
        resp, took = post(client, **heavy)
        results.append((resp.status_code, took, resp.text[:200]))

    threads = [threading.Thread(target=heavy_request) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    resp, beside = post(client, max_tokens=4)
    for thread in threads:
        thread.join(timeout=60)
    assert resp.status_code == 200 and [r[0] for r in results] == [200, 200], results
    # The heavy requests share the steps; the small one's added wait stays bounded.
    assert beside < alone + 3.0, (alone, beside, results)
