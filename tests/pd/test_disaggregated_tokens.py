"""A disaggregated request (prefill on the producer with max_tokens 1, decode on the consumer
with the producer's kv_transfer_params) answers exactly as one instance does: tokens and
logprobs, completions and chat, two architectures, two KV formats, both transports; the
consumer loads the transferred blocks instead of computing them, and every block comes back on
both sides."""

from __future__ import annotations

import pytest

from tests.engine.conftest import hf_greedy
from tests.pd.conftest import (
    BLOCK_SIZE,
    assert_blocks_back,
    assert_same_answer,
    body,
    cached,
    one_instance,
    pd_pair,
    post,
    prefill,
    utility,
)

# (transport, model fixture, KV cache dtype); qwen2_mixed: a full and two sliding layers (two
# KV cache groups, each group's blocks transferred)
CASES = [("store", "tiny_llama", "auto"), ("push", "tiny_llama", "int8"),
         ("push", "tiny_qwen3", "auto"), ("store", "tiny_qwen3", "int8"),
         ("push", "tiny_qwen2_mixed", "auto")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def pair(request, tmp_path_factory):
    connector, model, kv_dtype = request.param
    model_dir = request.getfixturevalue(model)
    with pd_pair(model_dir, connector, tmp_path_factory.mktemp("pd"), kv_dtype) as made:
        made.model_dir = model_dir
        made.kv_dtype = kv_dtype
        yield made



def test_completion_equals_one_instance_and_loads_the_transferred_blocks(pair):
    prompt = [5 + (i * 7) % 180 for i in range(37)]  # 9 full blocks and one token
    request = body(prompt)
    first = prefill(pair.a, request)
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transport"] == pair.connector
    assert params["num_tokens"] == 9 * BLOCK_SIZE == len(params["block_hashes"]) * BLOCK_SIZE
    assert params["num_blocks"] >= 9 and params["transfer_seconds"] >= 0
    block_bytes = utility(pair.a, "kv_transfer.describe")["block_bytes"]
    assert params["transfer_bytes"] == params["num_blocks"] * block_bytes
    assert first["usage"]["completion_tokens"] == 1
    decoded = post(pair.b, request, params)
    assert cached(decoded) == 9 * BLOCK_SIZE  # the prompt was loaded, not computed
    assert_same_answer(decoded, one_instance(pair, request))
    if pair.kv_dtype == "auto":  # and what transformers computes
        tokens = decoded["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 6
        assert post(pair.b, {**request, "logprobs": None, "return_token_ids": True,
                             "cache_salt": "hf"})["choices"][0]["token_ids"] == hf_greedy(
            pair.model_dir, prompt, 6)
    assert_blocks_back(pair)


def test_a_prefix_hit_on_the_producer_still_transfers_every_block(pair):
    shared = [7 + (i * 11) % 170 for i in range(24)]
    warm = body(shared + [3, 4, 5, 6, 8])
    prefill(pair.a, warm)
    request = body(shared + [9, 10, 11, 12, 13, 14, 15, 16, 17])  # 33 tokens: 8 full blocks
    first = prefill(pair.a, request)
    assert cached(first) == len(shared)  # the producer reused the shared prefix
    params = first["kv_transfer_params"]
    assert params["num_tokens"] == 8 * BLOCK_SIZE
    decoded = post(pair.b, request, params)
    assert cached(decoded) == 8 * BLOCK_SIZE
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


def test_chat_equals_one_instance(pair):
    request = {"model": "m", "messages": [{"role": "user", "content": "tell me about blocks " * 6}],
               "max_tokens": 5, "temperature": 0.0, "logprobs": True, "top_logprobs": 1}
    params = prefill(pair.a, request)["kv_transfer_params"]
    assert params["num_tokens"] > 0
    decoded = post(pair.b, request, params)
    assert cached(decoded) == params["num_tokens"]
    assert_same_answer(decoded, one_instance(pair, request))
    stats = utility(pair.a, "kv_transfer.stats")
    assert stats["handoffs"] >= 1 and stats["bytes_sent"] > 0
    assert_blocks_back(pair)
