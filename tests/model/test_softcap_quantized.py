"""Gemma 2's soft-capped attention (softcap_attention.py) over every quantized KV cache format:
its logits equal those of the model-dtype cache attending over the K/V as the format rounds
them (the same math: exactly equal, or within a tight bound where the reference's cache rounds
once more), stay within a KL bound of the model-dtype cache, and sliding-window layers and
chunked prompts read the quantized blocks back (the runner does not wrap the backend)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from pagedkv.model.backends.quantized import QuantizedKVBackend
from pagedkv.model.kv_int8 import round_trip_per_token
from pagedkv.model.kv_quant import KVScales, round_trip
from pagedkv.model.runner import ModelRunner
from pagedkv.testing.kv_quant_accuracy import kl_divergence, prompt_logits, teacher_forced_logits

# Mean KL (nats) against the float32 cache of the tiny Gemma 2 (float32 weights, 48 prompt and
# 8 continuation tokens, seed 0), measured: bfloat16 1.6e-06, int8 9.9e-06, e4m3 4.4e-04 (per
# head and per layer alike: this model's heads get the same power-of-two scales), e5m2 1.7e-03;
# the bounds are those plus 50%.
KL_BOUND = {"bfloat16": 2.5e-6, "int8": 1.5e-5, "fp8": 6.6e-4, "fp8_per_layer": 6.6e-4,
            "fp8_e5m2": 2.6e-3}
# (kv_cache_dtype, fp8_scales) per format.
FORMATS = {"bfloat16": ("bfloat16", "per_head"), "int8": ("int8", "per_head"),
           "fp8": ("fp8", "per_head"), "fp8_per_layer": ("fp8", "per_layer"),
           "fp8_e5m2": ("fp8_e5m2", "per_head")}


class RoundedKV:
    """A layer's `kv_scales` stand-in on a model-dtype cache: attends over `round_kv(k)`,
    `round_kv(v)`, the step's K/V as a quantized cache gives them back (the reference)."""

    def __init__(self, round_k: Callable, round_v: Callable) -> None:
        self.round_k, self.round_v = round_k, round_v

    def attend(self, meta, q, k, v, k_cache, v_cache, scale, window):
        return meta.attend(q, self.round_k(k), self.round_v(v), k_cache, v_cache, scale, window)


def _fp8_round(scale, cache_dtype: torch.dtype) -> Callable:
    """x [T, kv_heads, D] through an fp8 cache of per-layer or per-head `scale`."""
    def rounded(x: torch.Tensor) -> torch.Tensor:
        s = torch.tensor(scale, dtype=x.dtype).reshape(-1, 1)  # [1 or kv_heads, 1]
        return round_trip(x / s, cache_dtype) * s
    return rounded


def _reference_rounding(runner: ModelRunner, name: str) -> list[RoundedKV]:
    """Per layer of `runner` (the quantized one): its format's rounding of K and V."""
    layers = runner.model.layers
    if name == "bfloat16":
        to_bf16 = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
        return [RoundedKV(to_bf16, to_bf16) for _ in layers]
    if name == "int8":
        return [RoundedKV(round_trip_per_token, round_trip_per_token) for _ in layers]
    dtype = runner.kv_cache.kv.dtype
    scales = [layer.self_attn.kv_scales for layer in layers]
    assert all(isinstance(s, KVScales) and s.per_head == (name != "fp8_per_layer")
               for s in scales)
    return [RoundedKV(_fp8_round(s.k_scale, dtype), _fp8_round(s.v_scale, dtype))
            for s in scales]


def _logits(runner: ModelRunner, tokens: list[int], continuation: list[int]) -> torch.Tensor:
    """Prompt logits in chunks of 16 (each chunk reads the earlier ones back from the cache;
    past the window of 8 on the sliding layers) and teacher-forced decodes after it."""
    return torch.cat([prompt_logits(runner, tokens, chunk_size=16),
                      teacher_forced_logits(runner, tokens, continuation)[1:]])


def _tokens(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [rng.randrange(4, 300) for _ in range(48)], [rng.randrange(4, 300) for _ in range(8)]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantized_softcap_equals_attending_the_rounded_kv(tiny_gemma2, name):
    cache_dtype, fp8_scales = FORMATS[name]
    tokens, cont = _tokens(0)
    runner = ModelRunner(tiny_gemma2, block_size=4, num_blocks=64, device="cpu",
                         kv_cache_dtype=cache_dtype, fp8_scales=fp8_scales)
    assert not isinstance(runner.attn_backend, QuantizedKVBackend)
    assert runner.layer_groups is not None  # sliding and full layers: two KV cache groups
    got = _logits(runner, tokens, cont)
    plain = ModelRunner(tiny_gemma2, block_size=4, num_blocks=64, device="cpu")
    model_dtype = _logits(plain, tokens, cont)
    for layer, rounding in zip(plain.model.layers, _reference_rounding(runner, name),
                               strict=True):
        layer.self_attn.kv_scales = rounding
    reference = _logits(plain, tokens, cont)
    assert torch.isfinite(got).all()
    assert torch.equal(got, reference), float((got - reference).abs().max())
    kl = kl_divergence([model_dtype], [got])
    assert 0.0 < kl.mean_kl < KL_BOUND[name], kl


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_bfloat16_weights(tiny_gemma2, cache_dtype):
    """bfloat16 weights: the same math again (equal logits) against a float32 cache holding the
    rounded K/V as float32 (int8's dequantized values are not bfloat16 numbers; fp8's are)."""
    tokens, cont = _tokens(1)
    runner = ModelRunner(tiny_gemma2, block_size=4, num_blocks=64, device="cpu",
                         dtype="bfloat16", kv_cache_dtype=cache_dtype)
    got = _logits(runner, tokens, cont)
    plain = ModelRunner(tiny_gemma2, block_size=4, num_blocks=64, device="cpu",
                        dtype="bfloat16", kv_cache_dtype="float32")
    for layer, rounding in zip(plain.model.layers, _reference_rounding(runner, cache_dtype),
                               strict=True):
        layer.self_attn.kv_scales = RoundedKV(lambda x, r=rounding.round_k: r(x.float()),
                                              lambda x, r=rounding.round_v: r(x.float()))
    reference = _logits(plain, tokens, cont)
    assert torch.isfinite(got).all()
    assert torch.equal(got, reference), float((got - reference).abs().max())
