"""kv_cache_dtype in the block arithmetic: the cache dtype is taken separately from the model's,
so an fp8 block holds the same tokens in half the bytes of bfloat16 (a quarter of float32), and
the same budget holds exactly twice (four times) the blocks; `pagedkv plan --kv-cache-dtype`."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.config.dtypes import KV_CACHE_DTYPE_CHOICES, resolve_kv_cache_dtype
from pagedkv.engine.args import EngineArgs
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.plan import plan_num_blocks
from pagedkv.kv.spec import bundled_config_path
from tests.kv.test_spec import DEEPSEEK_V2_LITE, MISTRAL_7B_V01

LLAMA = bundled_config_path("llama-3-8b")
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "max_position_embeddings": 8192,
                "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16"}


def test_choices_are_vllms():
    assert KV_CACHE_DTYPE_CHOICES == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8",
                                      "float32", "bfloat16", "float16")
    assert resolve_kv_cache_dtype("auto", "bf16") == "bfloat16"
    assert resolve_kv_cache_dtype("fp8", "bfloat16") == "fp8"


@pytest.mark.parametrize("model_dtype, cache_dtype, block_bytes", [
    ("bfloat16", "auto", 2 * 2**20),  # 16 tokens x 32 layers x 2 x 8 heads x 128 x 2 bytes
    ("float32", "auto", 4 * 2**20),
    ("bfloat16", "fp8", 2**20),
    ("bfloat16", "fp8_e4m3", 2**20),
    ("float32", "fp8_e5m2", 2**20),
    # int8: 1 byte per value plus a float32 scale per token, head, layer and K/V:
    # 16 x 32 x 2 x 8 x (128 + 4) bytes
    ("bfloat16", "int8", 16 * 32 * 2 * 8 * 132),
    ("float32", "bfloat16", 2 * 2**20),
])
def test_block_bytes_and_counts_per_cache_dtype(model_dtype, cache_dtype, block_bytes):
    spec = kv_cache_spec_from_hf_config(LLAMA_CONFIG, 16, model_dtype, cache_dtype)
    assert spec.page_size_bytes == block_bytes
    plan = plan_num_blocks(spec, memory_bytes=10 * 2**30, utilization=1.0)
    assert plan.num_blocks == 10 * 2**30 // block_bytes  # 5120 bf16, 2560 fp32, 10240 fp8
    assert plan.max_cached_tokens == plan.num_blocks * 16


def test_fp8_halves_sliding_window_and_mla_blocks_too():
    for config in (MISTRAL_7B_V01, DEEPSEEK_V2_LITE):
        bf16 = kv_cache_spec_from_hf_config(config, 16, "bfloat16")
        fp8 = kv_cache_spec_from_hf_config(config, 16, "bfloat16", "fp8")
        assert (bf16.kind, bf16.dtype, fp8.dtype) == (fp8.kind, "bfloat16", "fp8")
        assert fp8.page_size_bytes * 2 == bf16.page_size_bytes


@pytest.mark.parametrize("bad", ["int4", "fp8_e4m3fn", "FP8", "", None, "bf16"])
def test_bad_cache_dtypes_are_value_errors_naming_them(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_spec_from_hf_config(LLAMA_CONFIG, 16, "bfloat16", bad)
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
        EngineArgs(model="m", kv_cache_dtype=bad)


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", "--config", LLAMA, "--memory", "80GiB", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_reports_the_doubled_block_count(capsys):
    auto = _plan_json(capsys)
    fp8 = _plan_json(capsys, "--kv-cache-dtype", "fp8")
    # Weights and activations stay bfloat16 estimates; only the KV blocks shrink:
    # (floor(80 GiB x 0.9) - 16,060,522,496 - 531,103,744) // 2 MiB = 28,952 blocks of bfloat16,
    # and the same bytes // 1 MiB = 57,904 blocks of fp8.
    assert (auto["weights_bytes"], auto["activation_peak_bytes"]) == (
        fp8["weights_bytes"], fp8["activation_peak_bytes"]) == (16_060_522_496, 531_103_744)
    assert (auto["dtype"], auto["bytes_per_block"], auto["num_blocks"]) == (
        "bfloat16", 2_097_152, 28_952)
    assert (fp8["dtype"], fp8["bytes_per_block"], fp8["num_blocks"]) == ("fp8", 1_048_576, 57_904)
    assert fp8["max_concurrent_seqs"] == 57_904 // 512  # 8192-token sequences of 512 blocks
    assert auto["max_concurrent_seqs"] == 28_952 // 512


def test_plan_counts_int8_scales_in_its_blocks(capsys):
    """int8 blocks carry a float32 scale per token, head, layer and K/V: 132 bytes per head
    vector of 128 values, so 128/132 of twice the bfloat16 cache's blocks in the same bytes."""
    auto = _plan_json(capsys)
    int8 = _plan_json(capsys, "--kv-cache-dtype", "int8")
    free = 60_717_785_088  # floor(80 GiB x 0.9) - weights - activation peak, as above
    assert auto["num_blocks"] == free // 2_097_152
    assert (int8["dtype"], int8["bytes_per_block"]) == ("int8", 16 * 32 * 2 * 8 * 132)
    assert int8["num_blocks"] == free // 1_081_344 == 56_150  # 1.94x of 28,952
    assert int8["max_concurrent_seqs"] == 56_150 // 512


def test_plan_table_names_the_cache_dtype_and_rejects_bad_ones(capsys):
    assert main(["plan", "--config", LLAMA, "--memory", "80GiB",
                 "--kv-cache-dtype", "fp8_e5m2"]) == 0
    out = capsys.readouterr().out
    assert "128 head size x fp8_e5m2" in out and "57,904" in out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--config", LLAMA, "--memory", "80GiB", "--kv-cache-dtype", "int4"])
    assert exc.value.code == 2
    assert "'int4'" in capsys.readouterr().err
