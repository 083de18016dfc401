"""int8 KV cache (kv_cache_dtype="int8"): symmetric int8 with one scale per token and KV head.

Scheme (vLLM's per-token-head int8, llama.cpp's q8_0 with a block of one head vector): when a
token's key (or value) of one KV head, x [head_dim], is written, its scale s is the one of
SCALE_FACTORS x max|x| / 127 (float32) whose round trip is closest to x (least squared error:
the grid of values moves against x's, about 13% less squared error than max|x| / 127 alone on
Gaussian vectors; a factor below 1 saturates the largest values at +-127), and the stored value
round(x / s) in [-127, 127] (round half to even; s = 0 and all zeros for a zero vector). The
errors are compared exactly (`_squared_errors`: integers), so every implementation picks the
same scale. The scales need no calibration and never change, so
a block's bytes and its scales together mean the same thing everywhere: the scales live beside
the block (`KVCache.scales_kv`, [layers, 2, kv_heads, num_blocks, block_size] float32), move
with it (swap, copy-on-write, the offload tiers' rows) and count in its bytes
(`KVCacheSpec.page_size_bytes`). Every conversion between model values and the int8 cache is
here; the C++ kernels (pagedkv/kernels/csrc/) and the Triton store
(backends/triton_int8_store.py) round the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

INT8_MAX = 127.0


# The candidate scales, in units of max|x| / 127: 1 + i SCALE_STEP for i = SCALE_FIRST ..
# SCALE_FIRST + SCALE_COUNT - 1 (exact in float32; ties go to the first, the smallest). Factors
# below 1 saturate the largest value, so all but one start at 1 (a search over i = -16 .. 15 showed
# that the 15 lowest almost never win, and they cost half the write). The C++ write
# (cache_write.cpp, write_kv_int8_) and the Triton one (triton_int8_store.py) use the same.
SCALE_FIRST = -1
SCALE_COUNT = 16
SCALE_STEP = 1 / 256
SCALE_FACTORS = tuple(1.0 + i * SCALE_STEP for i in range(SCALE_FIRST, SCALE_FIRST + SCALE_COUNT))
# The squared errors are counted in units of 2^-ERROR_BITS of a power of two near max|x| / 127.
ERROR_BITS = 20


def _squared_errors(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                    base: torch.Tensor) -> torch.Tensor:
    """sum((x - q * scales)^2) over the last dim (int64 [...]), exactly: x - q * s is exact in
    float64 (float32 x, 8-bit q, float32 s), scaled by a power of two (2^(ERROR_BITS + 1 - e),
    base = m * 2^e, m in [0.5, 1)), rounded half to even to an integer (|d| <= 8 base, so below
    2^24), squared and summed in int64: no order of summation can change it."""
    d = x.double() - q.double() * scales.double().unsqueeze(-1)
    power = ERROR_BITS + 1 - torch.frexp(base).exponent.long()
    unit_scale = ((power + 1023) << 52).view(torch.float64)  # 2^power, built from its bits
    units = torch.round(d * unit_scale.unsqueeze(-1)).long()
    return (units * units).sum(-1)


def quantize_per_token(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [..., D], float32 scales [...]) of `values` [..., D] (new tensors), the scale
    of each vector the module docstring's: the least squared round-trip error."""
    x = values.float()
    base = x.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(base > 0, base, torch.ones_like(base))
    best_q = best_s = best_err = None
    for factor in SCALE_FACTORS:
        s = safe * factor
        q = torch.round(x / s.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
        err = _squared_errors(x, q, s, safe)
        if best_err is None:
            best_q, best_s, best_err = q, s, err
            continue
        better = err < best_err
        best_q = torch.where(better.unsqueeze(-1), q, best_q)
        best_s = torch.where(better, s, best_s)
        best_err = torch.where(better, err, best_err)
    scales = torch.where(base > 0, best_s, torch.zeros_like(base))
    return best_q.to(torch.int8), scales


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
        int8, "int8" in `reads_cache_dtypes`, QuantizedKVBackend's, or softcap_attention's
        `SoftcappedMetadata`) quantizes k, v into the caches (mutated) and attends q over
        them."""
        return meta.attend(q, k, v, k_cache, v_cache, scale, window,
                           k_scales=self.k_scales, v_scales=self.v_scales)
