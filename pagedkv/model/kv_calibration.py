"""The fp8 KV cache's per-head (or per-tensor) scales, computed once per engine from the model itself.

Why computed and not given: vLLM reads calibrated `k_scale` / `v_scale` from quantized
checkpoints and otherwise uses 1.0, which clips keys larger than 448 (e4m3; some models' keys
have such outliers, e.g. from q/k biases) and wastes precision on small ones. Our checkpoints are
plain bf16/fp32 Hugging Face ones without scales, so the runner computes them before it
allocates the cache: one prefill of `CALIBRATION_TOKENS` fixed token ids through the model with
a scratch cache in the model's dtype, then each layer's (and KV head's: per-head scales, the
default, follow heads whose ranges differ by orders of magnitude) K and V absolute maximum, turned into a
power-of-two scale with 4x headroom (kv_quant.fp8_scale); larger values later saturate, never
overflow. The inputs are fixed and the model's, so the scales are a function of the weights:
deterministic, the same in every process, and identical for the device cache, the host swap pool
and the offload tiers (whose keys include them, so a cache with other scales never reads them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.spec import FullAttentionSpec
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.kv_cache import KVCache
from pagedkv.model.kv_quant import KVScales, fp8_scale

CALIBRATION_TOKENS = 256


def calibration_token_ids(num_tokens: int, vocab_size: int) -> torch.Tensor:
    """Fixed, well-spread token ids (a stride through the vocabulary; no RNG)."""
    return (torch.arange(num_tokens, dtype=torch.long) * 7919 + 13) % vocab_size


@torch.inference_mode()
def calibrate_kv_scales(model: Any, backend: Any, spec: FullAttentionSpec, model_dtype: str,
                        cache_dtype: torch.dtype, vocab_size: int, max_tokens: int,
                        device: torch.device, per_head: bool = True) -> list[KVScales]:
    """One `KVScales` per layer for a `cache_dtype` cache shaped like `spec`: runs `model` once
    over min(CALIBRATION_TOKENS, max_tokens) fixed tokens with `backend` (an unquantized one)
    and a scratch cache of `model_dtype`, freed on return. `per_head`: one scale per KV head
    (from that head's absolute maximum), else one per layer. The model is not mutated."""
    n = min(CALIBRATION_TOKENS, max_tokens)
    bs = spec.block_size
    num_blocks = -(-n // bs)
    # One slot per model layer (KV cache groups: the all-full layout; attention still applies
    # each layer's window), so the amax below is per model layer.
    scratch_spec = spec.all_layers_spec(model_dtype) if isinstance(spec, HybridKVCacheSpec) \
        else replace(spec, dtype=model_dtype)
    scratch = KVCache.from_spec(scratch_spec, num_blocks=num_blocks + 1, device=device)
    step = StepSequences(num_new_tokens=[n], seq_lens=[n],
                         block_tables=[list(range(1, num_blocks + 1))],
                         slot_mapping=list(range(bs, bs + n)), num_decodes=0, block_size=bs)
    ids = calibration_token_ids(n, vocab_size).to(device)
    positions = torch.arange(n, dtype=torch.long, device=device)
    model(ids, positions, scratch.layers, backend.build_metadata(step))
    if not per_head:
        amax = scratch.kv.abs().amax(dim=(2, 3, 4, 5)).float().tolist()  # [layers][K, V]
        return [KVScales(fp8_scale(k, cache_dtype), fp8_scale(v, cache_dtype)) for k, v in amax]
    amax = scratch.kv.abs().amax(dim=(3, 4, 5)).float().tolist()  # [layers][K, V][kv_heads]
    return [KVScales(tuple(fp8_scale(a, cache_dtype) for a in k),
                     tuple(fp8_scale(a, cache_dtype) for a in v)) for k, v in amax]
