"""One reader of config.json: the KV cache and the model agree on windows, dtype and bytes."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.config import HFModelConfig
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.kv_setup import plan_kv_cache
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.spec import FullAttentionSpec, SlidingWindowSpec
from pagedkv.model.registry import model_config_from_dict, model_config_from_dir
from pagedkv.model.runner import ModelRunner
from pagedkv.testing import build_random_model_dir

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 640, "max_position_embeddings": 512,
    "torch_dtype": "float32", "sliding_window": 4096, "max_window_layers": 0,
}


def test_qwen2_sliding_window_without_use_sliding_window_is_full_attention_everywhere(tmp_path):
    # transformers' Qwen2Config drops sliding_window unless use_sliding_window is true.
    spec = kv_cache_spec_from_hf_config(QWEN2, block_size=16)
    assert type(spec) is FullAttentionSpec and spec.sliding_window is None
    assert model_config_from_dict(QWEN2).layer_sliding_windows == (None,) * 4
    # And through the engine's sizing of a real model directory.
    d = build_random_model_dir(tmp_path / "q", "qwen2", num_layers=2)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("use_sliding_window")
    cfg.update(sliding_window=4, max_window_layers=0)
    (d / "config.json").write_text(json.dumps(cfg))
    setup = plan_kv_cache(EngineArgs(model=str(d), block_size=4, device="cpu"))
    assert setup.sliding_window is None and type(setup.spec) is FullAttentionSpec
    assert model_config_from_dir(d).layer_sliding_windows == (None, None)


def test_qwen2_use_sliding_window_and_max_window_layers_mix_layers():
    mixed = {**QWEN2, "use_sliding_window": True, "max_window_layers": 1}
    windows = (None, 4096, 4096, 4096)
    assert HFModelConfig.from_dict(mixed).layer_sliding_windows == windows
    assert model_config_from_dict(mixed).layer_sliding_windows == windows
    # Mixed layers: a KV cache group per attention type (1 full layer, 3 sliding: groups of
    # one layer each), the windows from the same reader.
    spec = kv_cache_spec_from_hf_config(mixed)
    assert type(spec) is HybridKVCacheSpec
    assert [g.sliding_window for g in spec.groups] == [None, 4096, 4096, 4096]
    all_slide = {**mixed, "max_window_layers": 0}
    assert model_config_from_dict(all_slide).layer_sliding_windows == (4096,) * 4
    assert type(kv_cache_spec_from_hf_config(all_slide)) is SlidingWindowSpec


def test_gemma_style_alternating_windows_are_read_per_layer():
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2304,
              "sliding_window": 4096}
    assert HFModelConfig.from_dict(gemma2).layer_sliding_windows == (4096, None, 4096, None)
    gemma3 = {**gemma2, "model_type": "gemma3_text", "num_hidden_layers": 7}
    assert HFModelConfig.from_dict(gemma3).layer_sliding_windows == (4096,) * 5 + (None, 4096)
    assert [(g.sliding_window, g.layer_ids) for g in kv_cache_spec_from_hf_config(gemma2).groups] \
        == [(None, (1, 3)), (4096, (0, 2))]


def test_config_without_dtype_is_sized_and_allocated_in_the_same_dtype(tmp_path):
    d = build_random_model_dir(tmp_path / "nodtype", num_layers=2)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["torch_dtype"]
    (d / "config.json").write_text(json.dumps(cfg))
    setup = plan_kv_cache(EngineArgs(model=str(d), block_size=4, device="cpu",
                                     num_gpu_blocks_override=16))
    runner = ModelRunner(d, block_size=4, num_blocks=setup.num_blocks, device="cpu")
    assert setup.spec.dtype == "float32" and runner.dtype == torch.float32
    assert runner.kv_cache.kv.dtype == torch.float32
    assert runner.kv_cache.kv.nbytes == setup.num_blocks * setup.spec.page_size_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_bytes_equal_allocated_bytes(tmp_path, dtype):
    d = build_random_model_dir(tmp_path / dtype, "qwen3", num_layers=3, num_heads=4,
                               num_kv_heads=1, head_dim=32, dtype=dtype)
    args = EngineArgs(model=str(d), block_size=8, device="cpu", num_gpu_blocks_override=12,
                      preemption_mode="swap", swap_space=0.001)
    setup = plan_kv_cache(args)
    runner = ModelRunner(d, block_size=8, num_blocks=setup.num_blocks,
                         num_host_blocks=setup.num_host_blocks, device="cpu",
                         kv_cache_spec=setup.spec)
    assert setup.num_host_blocks > 0
    assert runner.kv_cache.kv.nbytes == setup.num_blocks * setup.spec.page_size_bytes
    host = runner.kv_cache.host_kv  # host blocks have the same page size
    assert host.shape[3] >= setup.num_host_blocks
    assert host.nbytes == host.shape[3] * setup.spec.page_size_bytes
    with pytest.raises(ValueError, match="does not match"):
        ModelRunner(d, block_size=4, num_blocks=4, device="cpu", kv_cache_spec=setup.spec)


@pytest.mark.parametrize("overrides", [
    {}, {"use_sliding_window": True}, {"use_sliding_window": True, "max_window_layers": 2},
    {"use_sliding_window": True, "num_hidden_layers": 30, "max_window_layers": None},
    {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 4},
])
def test_qwen2_windows_match_transformers_config(overrides):
    transformers = pytest.importorskip("transformers")
    cfg = {k: v for k, v in {**QWEN2, **overrides}.items() if v is not None}
    ref = transformers.Qwen2Config(**cfg)
    expected = tuple(ref.sliding_window if t == "sliding_attention" else None
                     for t in ref.layer_types)
    assert HFModelConfig.from_dict(cfg).layer_sliding_windows == expected
