"""The fp8 KV cache's per-tensor scales, computed once per engine from the model itself.

Why computed and not given: vLLM reads calibrated `k_scale` / `v_scale` from quantized
checkpoints and otherwise uses 1.0, which clips keys larger than 448 (e4m3; some models' keys
have such outliers, e.g. from q/k biases) and wastes precision on small ones. Our checkpoints are
plain bf16/fp32 Hugging Face ones without scales, so the runner computes them before it
allocates the cache: one prefill of `CALIBRATION_TOKENS` fixed token ids through the model with
a scratch cache in the model's dtype, then each layer's K and V absolute maximum, turned into a
power-of-two scale with 4x headroom (kv_quant.fp8_scale); larger values later saturate, never
overflow. The inputs are fixed and the model's, so the scales are a function of the weights:
deterministic, the same in every process, and identical for the device cache, the host swap pool
and the offload tiers (whose keys include them, so a cache with other scales never reads them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

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
                        device: torch.device) -> list[KVScales]:
    """One `KVScales` per layer for a `cache_dtype` cache shaped like `spec`: runs `model` once
    over min(CALIBRATION_TOKENS, max_tokens) fixed tokens with `backend` (an unquantized one)
    and a scratch cache of `model_dtype`, freed on return. The model is not mutated."""
    n = min(CALIBRATION_TOKENS, max_tokens)
    bs = spec.block_size
    num_blocks = -(-n // bs)
    scratch = KVCache.from_spec(replace(spec, dtype=model_dtype), num_blocks=num_blocks + 1,
                                device=device)
    step = StepSequences(num_new_tokens=[n], seq_lens=[n],
                         block_tables=[list(range(1, num_blocks + 1))],
                         slot_mapping=list(range(bs, bs + n)), num_decodes=0, block_size=bs)
    ids = calibration_token_ids(n, vocab_size).to(device)
    positions = torch.arange(n, dtype=torch.long, device=device)
    model(ids, positions, scratch.layers, backend.build_metadata(step))
    amax = scratch.kv.abs().amax(dim=(2, 3, 4, 5)).float().tolist()  # [layers][K, V]
    return [KVScales(fp8_scale(k, cache_dtype), fp8_scale(v, cache_dtype)) for k, v in amax]
