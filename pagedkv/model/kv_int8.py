"""int8 KV cache (kv_cache_dtype="int8"): symmetric int8 with one scale per token and KV head.

Scheme (vLLM's per-token-head int8, llama.cpp's q8_0 with a block of one head vector): when a
token's key (or value) of one KV head, x [head_dim], is written, its scale is
s = max|x| / 127 (float32) and the stored value round(x / s) in [-127, 127] (round half to even;
s = 0 and all zeros for a zero vector). The scales need no calibration and never change, so
a block's bytes and its scales together mean the same thing everywhere: the scales live beside
the block (`KVCache.scales_kv`, [layers, 2, kv_heads, num_blocks, block_size] float32), move
with it (swap, copy-on-write, the offload tiers' rows) and count in its bytes
(`KVCacheSpec.page_size_bytes`). Every conversion between model values and the int8 cache is
here; the C++ kernels (pagedkv/kernels/cpu_ops.cpp) round the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

INT8_MAX = 127.0


def quantize_per_token(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [..., D], float32 scales [...]) of `values` [..., D] (new tensors):
    value * scale gives `values` back to within scale / 2."""
    x = values.float()
    scales = x.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(x / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def dequantize_per_token(values: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """int8 `values` [..., D] times float32 `scales` [...], as `dtype` (a new tensor)."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def round_trip_per_token(values: torch.Tensor) -> torch.Tensor:
    """`values` as the int8 cache gives them back (same dtype as `values`)."""
    return dequantize_per_token(*quantize_per_token(values), values.dtype)


def quantize_into_per_token(cache: torch.Tensor, scale_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store `values` [T, kv_heads, D] as int8 in slots `slot_mapping` [T] (int64, all >= 0)
    of `cache` [kv_heads, num_blocks, block_size, D] (int8) and their scales in `scale_cache`
    [kv_heads, num_blocks, block_size] (float32); both mutated."""
    h, nb, bs, d = cache.shape
    q, scales = quantize_per_token(values)
    cache.view(h, nb * bs, d).index_copy_(1, slot_mapping, q.transpose(0, 1))
    scale_cache.view(h, nb * bs).index_copy_(1, slot_mapping, scales.transpose(0, 1))


@dataclass(frozen=True)
class PerTokenScales:
    """One layer's int8 scale caches (views of `KVCache.scales_kv`): `k_scales`, `v_scales`
    [kv_heads, num_blocks, block_size] float32. Valid while the KV cache they view lives."""

    k_scales: torch.Tensor
    v_scales: torch.Tensor

    def attend(self, meta: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """`meta.attend` with this layer's scale caches: the backend's metadata (one that reads
        int8, `reads_int8_cache`, or QuantizedKVBackend's) quantizes k, v into the caches
        (mutated) and attends q over them."""
        return meta.attend(q, k, v, k_cache, v_cache, scale, window,
                           k_scales=self.k_scales, v_scales=self.v_scales)
