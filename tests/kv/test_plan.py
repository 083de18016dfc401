"""Capacity planning (blocks from a memory budget), weight/activation estimates and sizes."""

from __future__ import annotations

import pytest

from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.plan import (
    default_max_model_len,
    estimate_activation_peak_bytes,
    estimate_num_params,
    estimate_weights_bytes,
    plan_num_blocks,
)
from pagedkv.kv.sizes import format_size, parse_size
from pagedkv.kv.spec import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
from tests.kv.test_spec import DEEPSEEK_V2_LITE, LLAMA_3_8B, QWEN2_7B

GiB = 2**30
LLAMA_SPEC = FullAttentionSpec(16, 8, 128, "bfloat16", 32)  # 2 MiB per block


def test_blocks_from_budget_exact_figures():
    # (10 GiB x 1.0 - 2 GiB weights) / 2 MiB per block = 8 GiB / 2 MiB = 4096 blocks;
    # 4096 x 16 = 65536 tokens; 8192-token sequences need 512 blocks -> 8 at once;
    # 4 GiB swap / 2 MiB = 2048 host blocks.
    plan = plan_num_blocks(LLAMA_SPEC, memory_bytes=10 * GiB, utilization=1.0,
                           weights_bytes=2 * GiB, swap_space_bytes=4 * GiB, max_model_len=8192)
    assert (plan.bytes_per_token, plan.bytes_per_block) == (131072, 2097152)
    assert plan.num_blocks == 4096
    assert plan.num_host_blocks == 2048
    assert plan.max_cached_tokens == 65536
    assert plan.max_blocks_per_seq == 512
    assert plan.max_concurrent_seqs == 8
    assert plan.kv_cache_bytes == 8 * GiB
    assert plan.host_kv_cache_bytes == 4 * GiB


def test_utilization_and_activation_are_subtracted_and_rounded_down():
    # 10 GiB x 0.9 = 9 GiB; - 2 GiB weights - 1 GiB activations = 6 GiB -> 3072 blocks;
    # one byte less than that leaves 3071 (floor). 3072 // 512 = 6 sequences.
    plan = plan_num_blocks(LLAMA_SPEC, memory_bytes=10 * GiB, utilization=0.9,
                           weights_bytes=2 * GiB, activation_peak_bytes=GiB,
                           max_model_len=8192)
    assert (plan.num_blocks, plan.max_concurrent_seqs) == (3072, 6)
    tighter = plan_num_blocks(LLAMA_SPEC, memory_bytes=10 * GiB, utilization=0.9,
                              weights_bytes=2 * GiB + 1, activation_peak_bytes=GiB)
    assert tighter.num_blocks == 3071
    assert tighter.max_concurrent_seqs is None and tighter.max_blocks_per_seq is None


def test_host_blocks_round_down():
    plan = plan_num_blocks(LLAMA_SPEC, memory_bytes=GiB, utilization=1.0,
                           swap_space_bytes=5 * 2**20 - 1)  # 5 MiB - 1 byte / 2 MiB = 2
    assert plan.num_host_blocks == 2


def test_sliding_window_concurrency_counts_only_the_window():
    # Mistral layout, window 4096: 257 blocks per sequence at most. 2 GiB / 2 MiB = 1024
    # blocks -> 1024 // 257 = 3 sequences of 32768 tokens; full attention would need 2048
    # blocks for one of them and fail.
    spec = SlidingWindowSpec(16, 8, 128, "bfloat16", 32, sliding_window=4096)
    plan = plan_num_blocks(spec, memory_bytes=2 * GiB, utilization=1.0, max_model_len=32768)
    assert (plan.num_blocks, plan.max_blocks_per_seq, plan.max_concurrent_seqs) == (1024, 257, 3)
    with pytest.raises(ValueError, match="need 2048 blocks"):
        plan_num_blocks(LLAMA_SPEC, memory_bytes=2 * GiB, utilization=1.0, max_model_len=32768)


def test_mla_plan():
    # 497664 bytes per block (27 x 576 x 2 x 16); a budget of exactly 1000 blocks;
    # 1600-token sequences need 100 blocks -> 10 at once.
    spec = MLAAttentionSpec(16, 512, 64, "bfloat16", 27)
    plan = plan_num_blocks(spec, memory_bytes=497664 * 1000, utilization=1.0, max_model_len=1600)
    assert (plan.num_blocks, plan.max_concurrent_seqs, plan.max_cached_tokens) == (1000, 10, 16000)


def test_budget_too_small_for_one_sequence_reports_figures():
    # 10 GiB - 9.5 GiB weights = 0.5 GiB = 256 blocks < 512 for one 8192-token sequence.
    with pytest.raises(ValueError) as info:
        plan_num_blocks(LLAMA_SPEC, memory_bytes=10 * GiB, utilization=1.0,
                        weights_bytes=int(9.5 * GiB), max_model_len=8192)
    message = str(info.value)
    assert "need 512 blocks (1.00 GiB)" in message
    assert "max_model_len=8192" in message
    assert "budget gives 256" in message
    # Exactly enough for one sequence is fine.
    plan = plan_num_blocks(LLAMA_SPEC, memory_bytes=GiB, utilization=1.0, max_model_len=8192)
    assert (plan.num_blocks, plan.max_concurrent_seqs) == (512, 1)


def test_weights_larger_than_memory_give_zero_blocks_error():
    with pytest.raises(ValueError, match="budget gives 0"):
        plan_num_blocks(LLAMA_SPEC, memory_bytes=GiB, weights_bytes=2 * GiB, max_model_len=16)
    with pytest.raises(ValueError, match="not even one KV block"):
        plan_num_blocks(LLAMA_SPEC, memory_bytes=2**20)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"memory_bytes": 1.5}, "memory_bytes"),
        ({"utilization": 0}, "utilization"),
        ({"utilization": 1.5}, "utilization"),
        ({"weights_bytes": -1}, "weights_bytes"),
        ({"activation_peak_bytes": -1}, "activation_peak_bytes"),
        ({"swap_space_bytes": -1}, "swap_space_bytes"),
        ({"max_model_len": 0}, "max_model_len"),
    ],
)
def test_bad_plan_arguments_name_the_value(kwargs, name):
    args = {"memory_bytes": 10 * GiB, **kwargs}
    with pytest.raises(ValueError, match=name):
        plan_num_blocks(LLAMA_SPEC, **args)


def test_plan_to_dict():
    plan = plan_num_blocks(LLAMA_SPEC, memory_bytes=10 * GiB, utilization=1.0,
                           swap_space_bytes=4 * GiB, max_model_len=8192)
    d = plan.to_dict()
    assert d["kind"] == "full_attention"
    assert {k: d[k] for k in ("bytes_per_token", "bytes_per_block", "num_blocks",
                              "num_host_blocks", "max_cached_tokens", "max_concurrent_seqs")} == {
        "bytes_per_token": 131072, "bytes_per_block": 2097152, "num_blocks": 5120,
        "num_host_blocks": 2048, "max_cached_tokens": 81920, "max_concurrent_seqs": 10}
    assert d["spec"]["num_kv_heads"] == 8


def test_llama_3_8b_weights_estimate():
    # embed 128256 x 4096 = 525,336,576, twice (untied lm_head) = 1,050,673,152;
    # per layer: q,k,v,o 4096 x (4096 + 1024 + 1024) + 4096 x 4096 = 41,943,040,
    # MLP 3 x 4096 x 14336 = 176,160,768, two norms 8192 -> 218,112,000; x 32 = 6,979,584,000;
    # + final norm 4096 = 8,030,261,248 parameters (Meta's published count), x 2 bytes.
    assert estimate_num_params(LLAMA_3_8B) == 8_030_261_248
    assert estimate_weights_bytes(LLAMA_3_8B, "bfloat16") == 16_060_522_496
    assert estimate_weights_bytes(LLAMA_3_8B, "float32") == 4 * 8_030_261_248
    assert estimate_weights_bytes(LLAMA_3_8B) == 16_060_522_496  # auto: torch_dtype bfloat16


def test_tied_embeddings_drop_the_lm_head():
    tied = {**LLAMA_3_8B, "tie_word_embeddings": True}
    assert estimate_num_params(LLAMA_3_8B) - estimate_num_params(tied) == 128256 * 4096


def test_qwen2_gqa_weights_estimate_counts_qkv_bias():
    # Qwen2-7B: embed 152064 x 3584 = 544,997,376 (x2 untied); per layer: attention
    # 3584 x (3584 + 512 + 512) + 3584 x 3584 = 29,360,128 + q/k/v bias 4608,
    # MLP 3 x 3584 x 18944 = 203,685,888, norms 7168 -> 233,057,792; x 28 = 6,525,618,176;
    # + 1,089,994,752 + 3584 = 7,615,616,512 (published: 7.62B).
    assert estimate_num_params(QWEN2_7B) == 7_615_616_512


def test_mla_moe_weights_estimate_is_close_to_published():
    # DeepSeek-V2-Lite is published as 15.7B parameters; the estimate is approximate.
    params = estimate_num_params(DEEPSEEK_V2_LITE)
    assert 15.4e9 < params < 16.0e9


def test_activation_peak_estimate_formula():
    # per token: 4 x 64 (hidden buffers) + (4 + 2 x 2) x 16 (q, k, v) + 3 x 128 (MLP) = 768
    # elements; 100 tokens x 768 x 2 bytes = 153,600; logits + probs in float32 for
    # min(256, 100) = 100 rows: 2 x 100 x 1000 x 4 = 800,000 -> 953,600.
    tiny = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 1000, "num_hidden_layers": 2,
            "torch_dtype": "bfloat16"}
    assert estimate_activation_peak_bytes(tiny, 100, "bfloat16") == 953_600
    # 512 tokens, 4 sequences: 512 x 768 x 4 (float32) + 2 x 4 x 1000 x 4 = 1,604,864.
    assert estimate_activation_peak_bytes(tiny, 512, "float32", max_num_seqs=4) == 1_604_864
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        estimate_activation_peak_bytes(tiny, 0)


def test_default_max_model_len():
    assert default_max_model_len(LLAMA_3_8B) == 8192
    with pytest.raises(ValueError, match="max_position_embeddings"):
        default_max_model_len({"hidden_size": 64})


def test_real_config_end_to_end():
    spec = kv_cache_spec_from_hf_config(LLAMA_3_8B, block_size=16, dtype="bfloat16")
    plan = plan_num_blocks(spec, memory_bytes=80 * GiB, utilization=0.9,
                           weights_bytes=estimate_weights_bytes(LLAMA_3_8B),
                           max_model_len=default_max_model_len(LLAMA_3_8B))
    # floor(80 GiB x 0.9) = 77,309,411,328; - 16,060,522,496 = 61,248,888,832 / 2,097,152
    # = 29205.4 -> 29205 blocks; // 512 = 57 sequences of 8192 tokens.
    assert (plan.num_blocks, plan.max_concurrent_seqs) == (29205, 57)


# ------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30), ("80G", 80 * 2**30), ("80g", 80 * 2**30), ("80 gib", 80 * 2**30),
        ("80GB", 80 * 10**9), ("4GB", 4 * 10**9), ("512MiB", 512 * 2**20), ("512M", 512 * 2**20),
        ("512MB", 512 * 10**6), ("1.5GiB", 3 * 2**29), ("2KiB", 2048), ("2KB", 2000),
        ("1TiB", 2**40), ("1TB", 10**12), ("1024", 1024), ("1024B", 1024), (" 7 ", 7),
        ("0", 0), (".5KiB", 512), (1024, 1024), (0, 0),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "abc", "-1GiB", "1XB", "1.2.3G", "80 Gibibytes",
                                 -1, True, 1.5, None])
def test_parse_size_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="--memory"):
        parse_size(bad, name="--memory")


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(2097152) == "2.00 MiB"
    assert format_size(80 * 2**30) == "80.00 GiB"
    assert format_size(3 * 2**40) == "3.00 TiB"
    assert format_size(-(2**31)) == "-2.00 GiB"
