"""Request shapes a disaggregated fleet meets beyond the plain greedy completion, each answered
as one instance answers it and every block back on both sides: a prompt shorter than a block,
a prompt of whole blocks, a consumer that already holds the prompt's prefix, a producer asked
for more than one token, `n` > 1 samples, beam search, a streamed chat with usage, prompt
logprobs and echo."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.pd.conftest import (
    BLOCK_SIZE,
    PREFILL_PARAMS,
    TRANSFER_TIMEOUT_S,
    assert_blocks_back,
    assert_same_answer,
    body,
    cached,
    one_instance,
    pd_pair,
    post,
    prefill,
)


@pytest.fixture(scope="module", params=["push", "store"])
def pair(request, tiny_llama, tmp_path_factory):
    with pd_pair(tiny_llama, request.param, tmp_path_factory.mktemp("pd")) as made:
        yield made


def prompt_of(seed: int, length: int) -> list[int]:
    return [5 + (seed * 37 + i * 17) % 185 for i in range(length)]


def disaggregated(pair, request: dict) -> tuple[dict, dict]:
    """(the producer's params, the consumer's answer), the decode bounded in time."""
    params = prefill(pair.a, request)["kv_transfer_params"]
    start = time.monotonic()
    decoded = post(pair.b, request, params)
    assert time.monotonic() - start < TRANSFER_TIMEOUT_S + 5.0
    return params, decoded


def test_a_prompt_shorter_than_a_block_transfers_nothing_and_waits_for_nothing(pair):
    request = body(prompt_of(1, BLOCK_SIZE - 1))
    params = prefill(pair.a, request)["kv_transfer_params"]
    assert params["block_hashes"] == [] and params["num_tokens"] == 0
    start = time.monotonic()
    decoded = post(pair.b, request, params)
    assert time.monotonic() - start < TRANSFER_TIMEOUT_S  # nothing to wait for
    assert cached(decoded) == 0
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


def test_a_prompt_of_whole_blocks_recomputes_only_its_last_token(pair):
    request = body(prompt_of(2, 8 * BLOCK_SIZE))
    params, decoded = disaggregated(pair, request)
    assert params["num_tokens"] == 8 * BLOCK_SIZE
    # the last prompt token is computed for its logits: its block is not loaded
    assert cached(decoded) == 7 * BLOCK_SIZE
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


def test_a_consumer_holding_the_prefix_loads_only_the_rest(pair):
    shared = prompt_of(3, 5 * BLOCK_SIZE)
    post(pair.b, body(shared + [7, 8, 9], max_tokens=2))  # the consumer caches the prefix
    request = body(shared + prompt_of(4, 3 * BLOCK_SIZE + 2))
    params, decoded = disaggregated(pair, request)
    assert params["num_tokens"] == 8 * BLOCK_SIZE
    assert cached(decoded) == 8 * BLOCK_SIZE
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


def test_a_producer_asked_for_several_tokens_still_hands_the_prompt_over(pair):
    request = body(prompt_of(5, 30), max_tokens=5)
    sent = {**request, "kv_transfer_params": PREFILL_PARAMS}
    first = post(pair.a, sent)
    assert first["usage"]["completion_tokens"] == 5
    params = first["kv_transfer_params"]
    assert params["num_tokens"] == 7 * BLOCK_SIZE
    decoded = post(pair.b, request, params)
    assert cached(decoded) == 7 * BLOCK_SIZE
    want = one_instance(pair, request)
    assert_same_answer(decoded, want)
    assert first["choices"][0]["text"] == want["choices"][0]["text"][:len(
        first["choices"][0]["text"])]
    assert_blocks_back(pair)


def test_n_samples_with_a_seed_equal_one_instance(pair):
    request = body(prompt_of(6, 26), n=3, temperature=0.9, seed=1234, logprobs=None)
    params, decoded = disaggregated(pair, request)
    assert cached(decoded) == 6 * BLOCK_SIZE
    want = one_instance(pair, request)
    texts = sorted(c["text"] for c in decoded["choices"])
    assert len(texts) == 3 and texts == sorted(c["text"] for c in want["choices"])
    assert_blocks_back(pair)


def test_beam_search_equals_one_instance(pair):
    request = body(prompt_of(7, 22), n=2, use_beam_search=True, logprobs=None, max_tokens=4)
    params, decoded = disaggregated(pair, request)
    assert cached(decoded) == 5 * BLOCK_SIZE
    want = one_instance(pair, request)
    assert [c["text"] for c in decoded["choices"]] == [c["text"] for c in want["choices"]]
    assert_blocks_back(pair)


def test_a_streamed_chat_with_usage_equals_one_instance(pair):
    request = {"model": "m", "messages": [{"role": "user", "content": "stream the blocks " * 5}],
               "max_tokens": 5, "temperature": 0.0}
    params = prefill(pair.a, request)["kv_transfer_params"]
    with pair.b.stream("POST", "/v1/chat/completions", json={
            **request, "stream": True, "kv_transfer_params": params,
            "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 5
    assert cached(chunks[-1]) == params["num_tokens"] > 0
    assert text == one_instance(pair, request)["choices"][0]["message"]["content"]
    assert_blocks_back(pair)


def test_prompt_logprobs_and_echo_equal_one_instance(pair):
    """A prompt's logprobs need its logits: the consumer computes the prompt (a prefix hit is
    never taken for them), and the answer is one instance's."""
    for extra in ({"prompt_logprobs": 1}, {"echo": True}):
        request = body(prompt_of(8, 21), **extra)
        params, decoded = disaggregated(pair, request)
        want = one_instance(pair, request)
        got_choice, want_choice = decoded["choices"][0], want["choices"][0]
        assert got_choice["text"] == want_choice["text"]
        got_lp = got_choice["logprobs"]["token_logprobs"]
        want_lp = want_choice["logprobs"]["token_logprobs"]
        assert len(got_lp) == len(want_lp)
        assert all((g is None and w is None) or abs(g - w) < 1e-4
                   for g, w in zip(got_lp, want_lp, strict=True))
        if "prompt_logprobs" in extra:
            got_p, want_p = got_choice["prompt_logprobs"], want_choice["prompt_logprobs"]
            assert len(got_p) == len(want_p) == 21
            for g, w in zip(got_p[1:], want_p[1:], strict=True):
                assert g.keys() == w.keys()
                assert all(abs(g[k]["logprob"] - w[k]["logprob"]) < 1e-4 for k in g)
    assert_blocks_back(pair)


def test_concurrent_requests_sharing_a_prefix_equal_one_instance(pair, caplog):
    """Four requests with a common prefix, prefilled together and decoded together: the
    producer's handoffs and the consumer's loads interleave (a shared block may be loaded by
    one and found in the device cache by another), and each answer is one instance's."""
    shared = prompt_of(9, 4 * BLOCK_SIZE)
    requests = [body(shared + prompt_of(10 + i, 2 * BLOCK_SIZE + 1 + i)) for i in range(4)]
    with ThreadPoolExecutor(4) as pool, caplog.at_level(logging.WARNING, "pagedkv.server"):
        firsts = list(pool.map(lambda r: prefill(pair.a, r), requests))
        start = time.monotonic()
        decoded = list(pool.map(lambda rf: post(pair.b, rf[0], rf[1]["kv_transfer_params"]),
                                zip(requests, firsts, strict=True)))
    # no decode waited for shared blocks another one had already taken from the push tier
    assert "pushed blocks arrived" not in caplog.text
    assert time.monotonic() - start < TRANSFER_TIMEOUT_S + 2.0
    # the first admitted loads its blocks; one admitted in the same step as it may find the
    # shared blocks neither in the push tier (taken) nor yet in the device cache, and computes
    assert max(cached(answer) for answer in decoded) >= 6 * BLOCK_SIZE
    for request, answer in zip(requests, decoded, strict=True):
        assert_same_answer(answer, one_instance(pair, request))
    assert_blocks_back(pair)
