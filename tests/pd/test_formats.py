"""KV formats and architectures across a disaggregated pair: fp8 KV on both sides, sliding-window
models (Gemma 2's interleaved windows, Gemma 3's hybrid KV cache groups), and a producer and a
consumer that disagree on the KV cache dtype or the model's dtype: those params are refused and
the prompt computed, never loaded as the wrong bytes."""

from __future__ import annotations

import logging

import pytest

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

PROMPT = [6 + (i * 29) % 181 for i in range(30)]  # 7 full blocks and two tokens


@pytest.mark.parametrize(("connector", "model", "kv_dtype"), [
    ("push", "tiny_llama", "fp8"), ("store", "tiny_llama", "fp8_e5m2"),
    ("store", "tiny_gemma2", "auto"), ("push", "tiny_gemma3", "int8")])
def test_a_format_or_architecture_loads_and_equals_one_instance(request, tmp_path, connector,
                                                                model, kv_dtype):
    with pd_pair(request.getfixturevalue(model), connector, tmp_path, kv_dtype) as pair:
        req = body(PROMPT)
        params = prefill(pair.a, req)["kv_transfer_params"]
        assert params["num_tokens"] == 7 * BLOCK_SIZE
        assert params["kv_format"] == utility(pair.b, "kv_transfer.describe")["kv_format"]
        decoded = post(pair.b, req, params)
        assert cached(decoded) == 7 * BLOCK_SIZE
        assert_same_answer(decoded, one_instance(pair, req))
        assert_blocks_back(pair)


@pytest.mark.parametrize(("connector", "producer", "consumer"), [
    ("push", {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "auto"}),
    ("store", {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "int8"}),
    ("push", {"dtype": "float32"}, {"dtype": "bfloat16"}),
    ("store", {}, {"quantization": "int8"})])
def test_mismatched_formats_are_refused_and_recomputed(tiny_llama, tmp_path, caplog, connector,
                                                       producer, consumer):
    kv_dtype = producer.get("kv_cache_dtype", "auto")
    mismatched = {**consumer, "kv_cache_dtype": consumer.get("kv_cache_dtype", kv_dtype)}
    with pd_pair(tiny_llama, connector, tmp_path, kv_dtype, consumer_extra=mismatched) as pair:
        req = body(PROMPT)
        params = prefill(pair.a, req)["kv_transfer_params"]
        assert params["num_tokens"] == 7 * BLOCK_SIZE
        with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
            decoded = post(pair.b, req, params)
        assert "do not fit this request" in caplog.text
        assert cached(decoded) == 0
        assert_same_answer(decoded, one_instance(pair, req))
        # params forged to name the consumer's identity and format: the producer's blocks,
        # under the producer's keys, are still never found
        salted = {**req, "cache_salt": "forged"}
        own = utility(pair.b, "kv_transfer.describe")
        forged = {**prefill(pair.a, salted)["kv_transfer_params"],
                  "kv_format": own["kv_format"], "model_identity": own["model_identity"]}
        again = post(pair.b, salted, forged)
        assert cached(again) == 0
        assert_same_answer(again, one_instance(pair, req))
        assert_blocks_back(pair)


def test_a_hybrid_producer_and_a_full_layers_consumer_never_share_blocks(tiny_qwen2_mixed,
                                                                         tmp_path, caplog):
    """Sliding-window groups on the producer, every layer in one block on the consumer
    (disable_hybrid_kv_cache_manager): another layout, so another identity and block size; the
    pushed blocks are dropped on arrival and the prompt computed."""
    with pd_pair(tiny_qwen2_mixed, "push", tmp_path,
                 consumer_extra={"disable_hybrid_kv_cache_manager": True}) as pair:
        req = body(PROMPT)
        params = prefill(pair.a, req)["kv_transfer_params"]
        assert params["num_tokens"] == 7 * BLOCK_SIZE
        with caplog.at_level(logging.WARNING):
            decoded = post(pair.b, req, params)
        assert "do not fit this request (model identity" in caplog.text
        assert "dropped a push message: push header block_bytes" in caplog.text
        assert cached(decoded) == 0
        assert pair.consumer.core.kv_transfer.receiver.held_bytes == 0
        assert_same_answer(decoded, one_instance(pair, req))
        assert_blocks_back(pair)
