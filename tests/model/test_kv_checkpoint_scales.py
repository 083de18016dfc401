"""fp8 KV scales read from a checkpoint that carries them (kv_checkpoint_scales.py), in each of
the names vLLM reads: per layer or per KV head, used instead of calibrated ones; bad or partial
scales are a ValueError naming the tensor or the layer."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.model.kv_checkpoint_scales import read_checkpoint_kv_scales
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.kv_quant_accuracy import compare_logits, teacher_forced_logits
from pagedkv.testing.random_model import build_random_model_dir

LAYERS, KV_HEADS = 2, 2


def _with_scales(tmp_path, tensors: dict[str, torch.Tensor]):
    """A tiny random Llama (2 layers, 2 KV heads) whose checkpoint also holds `tensors`."""
    model_dir = build_random_model_dir(tmp_path / "m", seed=0, num_layers=LAYERS,
                                       num_kv_heads=KV_HEADS)
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    state.update(tensors)
    save_file(state, str(path), metadata={"format": "pt"})
    return model_dir


def _layer(i: int, suffix: str) -> str:
    return f"model.layers.{i}.self_attn.{suffix}"


def test_per_layer_scales_in_the_current_names_replace_the_calibrated_ones(tmp_path):
    tensors = {}
    for i in range(LAYERS):
        tensors[_layer(i, "k_scale")] = torch.tensor(0.03125 * (i + 1))
        tensors[_layer(i, "v_scale")] = torch.tensor(0.0078125 * (i + 1))
    model_dir = _with_scales(tmp_path, tensors)
    runner = ModelRunner(model_dir, block_size=4, num_blocks=32, device="cpu",
                         kv_cache_dtype="fp8", cpu_kernels="off")
    got = [(s.k_scale, s.v_scale) for s in runner.kv_scales]
    assert got == [(0.03125, 0.0078125), (0.0625, 0.015625)]
    assert [layer.self_attn.kv_scales for layer in runner.model.layers] == runner.kv_scales
    assert "0.03125" in runner.kv_cache.dtype_tag()  # the store key names the scales
    ref = ModelRunner(model_dir, block_size=4, num_blocks=32, device="cpu", cpu_kernels="off")
    prompt, cont = list(range(5, 45)), list(range(60, 70))
    diff = compare_logits(teacher_forced_logits(ref, prompt, cont),
                          teacher_forced_logits(runner, prompt, cont))
    # The tiny model's K/V stay within 448 x these scales: fp8 rounding only (as calibrated).
    assert 0.0 < diff.max_abs_error < 0.1, diff


def test_per_head_output_scales_and_a_shared_kv_scale(tmp_path):
    tensors = {_layer(0, "k_proj.output_scale"): torch.tensor([0.25, 0.5]),
               _layer(0, "v_proj.output_scale"): torch.tensor([0.125, 0.0625]),
               _layer(1, "kv_scale"): torch.tensor([0.375])}
    scales = read_checkpoint_kv_scales(_with_scales(tmp_path, tensors), LAYERS, KV_HEADS)
    assert [(s.k_scale, s.v_scale) for s in scales] == [((0.25, 0.5), (0.125, 0.0625)),
                                                       (0.375, 0.375)]
    # A tensor-parallel rank holding KV head 1 only reads its head's scale.
    scales = read_checkpoint_kv_scales(tmp_path / "m", LAYERS, KV_HEADS, heads=slice(1, 2))
    assert scales[0].k_scale == (0.5,) and scales[0].v_scale == (0.0625,)


def test_a_checkpoint_without_scales_is_calibrated(tmp_path):
    model_dir = _with_scales(tmp_path, {})
    assert read_checkpoint_kv_scales(model_dir, LAYERS, KV_HEADS) is None
    runner = ModelRunner(model_dir, block_size=4, num_blocks=8, device="cpu",
                         kv_cache_dtype="fp8", cpu_kernels="off")
    assert all(s.per_head for s in runner.kv_scales)  # calibrated, per head by default


@pytest.mark.parametrize("tensors, message", [
    ({_layer(0, "k_scale"): torch.tensor(0.0), _layer(0, "v_scale"): torch.tensor(1.0),
      _layer(1, "k_scale"): torch.tensor(1.0), _layer(1, "v_scale"): torch.tensor(1.0)},
     "'model.layers.0.self_attn.k_scale' must be finite and > 0, got [0.0]"),
    ({_layer(0, "k_scale"): torch.tensor(float("nan")), _layer(0, "v_scale"): torch.tensor(1.0),
      _layer(1, "kv_scale"): torch.tensor(1.0)}, "must be finite and > 0, got [nan]"),
    ({_layer(0, "k_scale"): torch.tensor(1.0), _layer(0, "v_scale"): torch.tensor(1.0)},
     "none for layer 1's keys"),
    ({_layer(0, "kv_scale"): torch.ones(3), _layer(1, "kv_scale"): torch.ones(1)},
     "has 3 values; expected 1 or one per KV head (2)"),
])
def test_bad_or_partial_scales_are_a_value_error(tmp_path, tensors, message):
    model_dir = _with_scales(tmp_path, tensors)
    with pytest.raises(ValueError) as err:
        ModelRunner(model_dir, block_size=4, num_blocks=8, device="cpu", kv_cache_dtype="fp8",
                    cpu_kernels="off")
    assert message in str(err.value)
