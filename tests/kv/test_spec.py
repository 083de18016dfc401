"""KV cache specs from real Hugging Face configs, with the figures worked out by hand."""

from __future__ import annotations

import json

import pytest

from pagedkv.config import (
    HFModelConfig,
    canonical_dtype,
    dtype_bytes,
    resolve_dtype,
)
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.spec import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    bundled_config_names,
    bundled_config_path,
)
from pagedkv.model.config_files import load_hf_config

# Trimmed to the keys that matter, values as published on the Hugging Face hub.
LLAMA_3_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
LLAMA_2_7B = {  # no num_key_value_heads key in the oldest configs: MHA, kv heads = heads
    "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000,
    "max_position_embeddings": 4096, "torch_dtype": "float16",
}
QWEN2_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
    "num_key_value_heads": 4, "num_hidden_layers": 28, "intermediate_size": 18944,
    "vocab_size": 152064, "max_position_embeddings": 131072, "max_window_layers": 28,
    "sliding_window": 131072, "use_sliding_window": False, "torch_dtype": "bfloat16",
}
QWEN3_0_6B = {  # explicit head_dim 128 while hidden_size / heads = 1024 / 16 = 64
    "model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 28,
    "intermediate_size": 3072, "vocab_size": 151936, "max_position_embeddings": 40960,
    "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
GEMMA_7B = {  # explicit head_dim 256 while hidden_size / heads = 3072 / 16 = 192
    "model_type": "gemma", "hidden_size": 3072, "num_attention_heads": 16,
    "num_key_value_heads": 16, "head_dim": 256, "num_hidden_layers": 28,
    "intermediate_size": 24576, "vocab_size": 256000, "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_V01 = {
    "model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,
    "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16,
    "num_key_value_heads": 16, "num_hidden_layers": 27, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
    "n_shared_experts": 2, "first_k_dense_replace": 1, "vocab_size": 102400,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
    "num_key_value_heads": 128, "num_hidden_layers": 61, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "max_position_embeddings": 163840, "torch_dtype": "bfloat16",
}


def test_llama_3_8b_gqa_bfloat16():
    # 32 layers x 2 (K, V) x 8 kv heads x 128 head size x 2 bytes = 131072 bytes per token;
    # x 16 tokens per block = 2097152 bytes (2 MiB) per block.
    spec = kv_cache_spec_from_hf_config(LLAMA_3_8B, block_size=16, dtype="bfloat16")
    assert spec == FullAttentionSpec(16, 8, 128, "bfloat16", 32)
    assert spec.bytes_per_token == 131072
    assert spec.page_size_bytes == 2097152
    assert spec.max_blocks_per_seq(8192) == 512  # 8192 / 16
    assert spec.max_blocks_per_seq(8193) == 513  # a partial block still takes a block


def test_qwen2_7b_gqa_with_use_sliding_window_false_is_full_attention():
    # head 3584 / 28 = 128; 28 layers x 2 x 4 kv heads x 128 x 2 bytes = 57344 bytes per token;
    # x 16 = 917504 per block. sliding_window 131072 is set but use_sliding_window is false.
    spec = kv_cache_spec_from_hf_config(QWEN2_7B)
    assert type(spec) is FullAttentionSpec
    assert (spec.num_kv_heads, spec.head_size, spec.num_layers) == (4, 128, 28)
    assert spec.bytes_per_token == 57344
    assert spec.page_size_bytes == 917504
    assert spec.max_blocks_per_seq(131072) == 8192


def test_qwen2_use_sliding_window_true_slides_only_when_every_layer_does():
    # Qwen2: layers with index >= max_window_layers slide. 0 -> all 28 slide.
    all_slide = {**QWEN2_7B, "use_sliding_window": True, "max_window_layers": 0,
                 "sliding_window": 4096}
    spec = kv_cache_spec_from_hf_config(all_slide)
    assert type(spec) is SlidingWindowSpec
    assert spec.sliding_window == 4096
    assert spec.bytes_per_token == 57344  # the same bytes per token as full attention
    assert spec.max_blocks_per_seq(131072) == 4096 // 16 + 1
    # max_window_layers 28 == num layers: no layer slides; 14: a mix, KV cache groups (14
    # layers each: one full group, one sliding group).
    none_slide = {**all_slide, "max_window_layers": 28}
    assert type(kv_cache_spec_from_hf_config(none_slide)) is FullAttentionSpec
    mixed = kv_cache_spec_from_hf_config({**all_slide, "max_window_layers": 14})
    assert type(mixed) is HybridKVCacheSpec and mixed.num_layers == 14
    assert [(g.sliding_window, g.layer_ids) for g in mixed.groups] == \
        [(None, tuple(range(14))), (4096, tuple(range(14, 28)))]
    assert mixed.page_size_bytes == spec.page_size_bytes // 2  # one block: 14 layers
    assert mixed.max_blocks_per_seq(131072) == 8192 + 4096 // 16 + 1
    # Without max_window_layers, transformers' Qwen2Config default (28) applies: in this
    # 28-layer model no layer slides; in a 40-layer one layers 28..39 do (a mix).
    no_mwl = {k: v for k, v in all_slide.items() if k != "max_window_layers"}
    assert type(kv_cache_spec_from_hf_config(no_mwl)) is FullAttentionSpec
    assert HFModelConfig.from_dict({**no_mwl, "num_hidden_layers": 40}).layer_sliding_windows \
        == (None,) * 28 + (4096,) * 12


def test_layer_types_decide_sliding_when_given():
    base = {**MISTRAL_7B_V01, "num_hidden_layers": 2}
    sliding = {**base, "layer_types": ["sliding_attention", "sliding_attention"]}
    mixed = {**base, "layer_types": ["sliding_attention", "full_attention"]}
    assert type(kv_cache_spec_from_hf_config(sliding)) is SlidingWindowSpec
    assert [g.sliding_window for g in kv_cache_spec_from_hf_config(mixed).groups] == [None, 4096]
    # Gemma-2 interleaves sliding and full layers: a group of each, 14 layers apiece.
    gemma2 = kv_cache_spec_from_hf_config({**GEMMA_7B, "model_type": "gemma2",
                                           "sliding_window": 4096})
    assert [(g.sliding_window, g.layer_ids) for g in gemma2.groups] == \
        [(None, tuple(range(1, 28, 2))), (4096, tuple(range(0, 28, 2)))]


def test_explicit_head_dim_wins_over_hidden_size_over_heads():
    # Qwen3-0.6B: 28 layers x 2 x 8 kv heads x 128 (head_dim, not 1024/16 = 64) x 2 = 114688.
    spec = kv_cache_spec_from_hf_config(QWEN3_0_6B)
    assert spec.head_size == 128
    assert spec.bytes_per_token == 114688
    # Gemma-7B: 28 layers x 2 x 16 kv heads x 256 (not 3072/16 = 192) x 2 = 458752; x16 = 7340032.
    gemma = kv_cache_spec_from_hf_config(GEMMA_7B)
    assert (gemma.head_size, gemma.bytes_per_token) == (256, 458752)
    assert gemma.page_size_bytes == 7340032


def test_missing_num_key_value_heads_means_one_kv_head_per_attention_head():
    # Llama-2-7B (MHA): 32 layers x 2 x 32 heads x 128 x 2 bytes (float16 via auto) = 524288.
    spec = kv_cache_spec_from_hf_config(LLAMA_2_7B)
    assert (spec.num_kv_heads, spec.dtype) == (32, "float16")
    assert spec.bytes_per_token == 524288


def test_mistral_sliding_window_bounds_resident_blocks():
    # Same bytes as Llama-3-8B (32 x 2 x 8 x 128 x 2 = 131072), window 4096 tokens:
    # at most 4096 / 16 + 1 = 257 blocks resident, whatever max_model_len is beyond that.
    spec = kv_cache_spec_from_hf_config(MISTRAL_7B_V01)
    assert spec == SlidingWindowSpec(16, 8, 128, "bfloat16", 32, sliding_window=4096)
    assert spec.bytes_per_token == 131072
    assert spec.max_blocks_per_seq(32768) == 257
    assert spec.max_blocks_per_seq(1000) == 63  # shorter than the window: cdiv(1000, 16)
    assert kv_cache_spec_from_hf_config(MISTRAL_7B_V01, block_size=32).max_blocks_per_seq(
        32768) == 129  # 4096 / 32 + 1


def test_mistral_with_null_sliding_window_is_full_attention():
    spec = kv_cache_spec_from_hf_config({**MISTRAL_7B_V01, "sliding_window": None})
    assert type(spec) is FullAttentionSpec
    assert spec.max_blocks_per_seq(32768) == 2048


def test_deepseek_v2_lite_mla_latent_per_token():
    # 27 layers x (kv_lora_rank 512 + qk_rope_head_dim 64 = 576) x 2 bytes = 31104 per token
    # (no factor 2: K and V share the latent); x 16 = 497664 per block.
    spec = kv_cache_spec_from_hf_config(DEEPSEEK_V2_LITE)
    assert spec == MLAAttentionSpec(16, 512, 64, "bfloat16", 27)
    assert (spec.num_kv_heads, spec.head_size) == (1, 576)
    assert spec.bytes_per_token == 31104
    assert spec.page_size_bytes == 497664


def test_deepseek_v3_mla():
    # 61 layers x 576 x 2 bytes = 70272 per token; block 64 -> 4497408 bytes per block.
    spec = kv_cache_spec_from_hf_config(DEEPSEEK_V3, block_size=64)
    assert spec.bytes_per_token == 70272
    assert spec.page_size_bytes == 4497408


@pytest.mark.parametrize(
    ("dtype", "per_token"),
    [
        ("float32", 262144), ("fp32", 262144), ("float", 262144),  # 32 x 2 x 8 x 128 x 4
        ("bfloat16", 131072), ("bf16", 131072), ("float16", 131072), ("half", 131072),
        ("fp8", 65536), ("fp8_e4m3", 65536), ("fp8_e5m2", 65536),  # x 1 byte
    ],
)
def test_dtypes_scale_bytes_per_token(dtype, per_token):
    assert kv_cache_spec_from_hf_config(LLAMA_3_8B, dtype=dtype).bytes_per_token == per_token


def test_auto_dtype_follows_the_config():
    assert kv_cache_spec_from_hf_config({**LLAMA_3_8B, "torch_dtype": "float32"}).dtype == "float32"
    newer = {k: v for k, v in LLAMA_3_8B.items() if k != "torch_dtype"}
    assert kv_cache_spec_from_hf_config({**newer, "dtype": "float16"}).dtype == "float16"
    assert kv_cache_spec_from_hf_config(newer).dtype == "float32"  # neither key: float32
    assert resolve_dtype("auto", {"torch_dtype": "torch.float16"}) == "float16"
    with pytest.raises(ValueError, match="torch_dtype"):
        kv_cache_spec_from_hf_config({**LLAMA_3_8B, "torch_dtype": "int4"})


def test_dtype_names():
    assert canonical_dtype("BF16") == "bfloat16"
    assert dtype_bytes("fp8") == 1 and dtype_bytes("float32") == 4
    for bad in ("int4", "auto", "", None):
        with pytest.raises(ValueError, match="dtype"):
            canonical_dtype(bad)
    with pytest.raises(ValueError, match="int8"):
        kv_cache_spec_from_hf_config(LLAMA_3_8B, dtype="int8")


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"num_attention_heads": None}, "num_attention_heads"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_key_value_heads": -8}, "num_key_value_heads"),
        ({"num_hidden_layers": "32"}, "num_hidden_layers"),
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_size": 4100}, "hidden_size"),  # not divisible by 32 heads, no head_dim
        ({"head_dim": 0}, "head_dim"),
        ({"sliding_window": -1}, "sliding_window"),
    ],
)
def test_missing_or_invalid_keys_name_the_key(change, key):
    config = {k: v for k, v in LLAMA_3_8B.items() if change.get(k, 1) is not None}
    config.update({k: v for k, v in change.items() if v is not None})
    with pytest.raises(ValueError, match=key):
        kv_cache_spec_from_hf_config(config)


def test_mla_missing_rope_dim_names_the_key():
    config = {k: v for k, v in DEEPSEEK_V2_LITE.items() if k != "qk_rope_head_dim"}
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        kv_cache_spec_from_hf_config(config)


def test_bad_arguments_and_non_dict_config():
    with pytest.raises(ValueError, match="block_size"):
        kv_cache_spec_from_hf_config(LLAMA_3_8B, block_size=0)
    with pytest.raises(ValueError, match="config"):
        kv_cache_spec_from_hf_config([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_kv_heads"):
        FullAttentionSpec(16, 0, 128, "bfloat16", 32)
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(16, 8, 128, "bfloat16", 32)
    with pytest.raises(ValueError, match="max_model_len"):
        FullAttentionSpec(16, 8, 128, "bfloat16", 32).max_blocks_per_seq(0)


def test_multimodal_text_config_is_used():
    config = {"model_type": "llava", "torch_dtype": "float16", "text_config": LLAMA_2_7B}
    spec = kv_cache_spec_from_hf_config(config)
    assert spec.bytes_per_token == 524288


def test_spec_to_dict_has_kind_and_figures():
    d = kv_cache_spec_from_hf_config(DEEPSEEK_V2_LITE).to_dict()
    assert d["kind"] == "mla"
    assert (d["bytes_per_token"], d["page_size_bytes"]) == (31104, 497664)


def test_load_hf_config_file_dir_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    assert load_hf_config(tmp_path) == LLAMA_3_8B
    assert load_hf_config(tmp_path / "config.json") == LLAMA_3_8B
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path / "..")  # a directory without config.json
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_hf_config(tmp_path / "list.json")


def test_bundled_llama_3_8b_config_is_metas():
    assert "llama-3-8b" in bundled_config_names()
    config = load_hf_config(bundled_config_path("llama-3-8b"))
    for key, value in LLAMA_3_8B.items():
        assert config[key] == value
    assert config["rope_theta"] == 500000.0 and config["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="no bundled config"):
        bundled_config_path("llama-9")


def test_every_bundled_config_builds_a_spec():
    kinds = {name: kv_cache_spec_from_hf_config(load_hf_config(bundled_config_path(name))).kind
             for name in bundled_config_names()}
    assert kinds["llama-3-8b"] == "full_attention"
    assert kinds["mistral-7b-v0.1"] == "sliding_window"
    assert kinds["deepseek-v2-lite"] == "mla"
    assert kinds["qwen2-7b"] == "full_attention"
