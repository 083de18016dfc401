"""fp8 KV cache: every conversion between the model's dtype and the cache's fp8, in one place.

Scheme (vLLM's per-tensor or per-head scales): each layer has one scale for its keys and one for
its values, or one of each per KV head (`KVScales`, the default: kv_calibration.py); a stored
fp8 value x8 stands for x8 * scale. The scales are computed once per
engine by `kv_calibration.calibrate_kv_scales` (why: see there and the README) and never change
afterwards, so a block means the same thing on the device, in the host swap pool and in every
offload tier (whose keys carry the scales, `KVCache.dtype_tag`).

Backends never see the scales: `KVScales.attend` divides the step's new k, v by their scales
before the backend stores them, multiplies the softmax scale by k_scale and the attention output
by v_scale. That is exact, q . (k8 * s_k) = (q . k8) * s_k and sum_i p_i (v8_i * s_v) =
s_v * sum_i p_i v8_i, and it is what vLLM's FlashInfer backend does (k_scale folded into
sm_scale, v_scale applied to the output). So a backend only converts: `quantize_into` on write
(saturating at the format's largest finite value: never inf or NaN), `dequantize` on read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# A layer's scale maps its calibrated absolute maximum to at most 1 / SCALE_HEADROOM of the fp8
# format's largest value (448 for e4m3): values up to SCALE_HEADROOM x larger than any seen while
# calibrating still fit; only values below amax / 2**(e4m3: 12) lose precision as subnormals.
SCALE_HEADROOM = 4.0


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds fp8 values (needs this module's conversions)."""
    return dtype in FP8_DTYPES


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as raw bytes (uint8, same shape) when it is fp8, else `t` itself: CPU torch has
    no index_copy_ for fp8, and moving fp8 values is copying their bytes."""
    return t.view(torch.uint8) if is_quantized(t.dtype) else t


def quantize(values: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`values / scale` in `cache_dtype`, clamped to its finite range when that is narrower
    than the values' (a new tensor). A wider cache (float32 under bfloat16 values) takes them
    as they are: its limit is not even a value of theirs."""
    limit = torch.finfo(cache_dtype).max
    scaled = values if scale == 1.0 else values / scale
    if limit < torch.finfo(scaled.dtype).max:
        scaled = scaled.clamp(-limit, limit)
    return scaled.to(cache_dtype)


def dequantize(blocks: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """fp8 `blocks` (any shape) as `dtype` values times `scale` (a new tensor)."""
    out = blocks.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def round_trip(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`values` as a cache of `cache_dtype` gives them back (same dtype as `values`)."""
    return dequantize(quantize(values, cache_dtype), values.dtype)


def quantize_into(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor,
                  scale: float = 1.0) -> None:
    """Store values [T, kv_heads, head_dim] / scale as fp8 in slots `slot_mapping` [T] (int64,
    all >= 0) of `cache` [kv_heads, num_blocks, block_size, head_dim] (fp8; mutated)."""
    h, nb, bs, d = cache.shape
    packed = quantize(values, cache.dtype, scale).transpose(0, 1)
    storage_view(cache).view(h, nb * bs, d).index_copy_(1, slot_mapping, storage_view(packed))


def fp8_scale(amax: float, cache_dtype: torch.dtype, headroom: float = SCALE_HEADROOM) -> float:
    """The per-tensor scale for values of absolute maximum `amax`: the smallest power of two
    >= amax * headroom / finfo(cache_dtype).max (1.0 when amax is 0 or not finite). A power of
    two makes dividing by it exact in every float format, and the same amax give the same scale
    on every machine up to a rounding at the powers' edges."""
    if not math.isfinite(amax) or amax <= 0.0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * headroom / torch.finfo(cache_dtype).max))


Scale = float | tuple[float, ...]  # one per layer, or one per KV head


@dataclass(frozen=True)
class KVScales:
    """One layer's fp8 scales: a stored key k8 of KV head h means k8 * k_scale (or
    k8 * k_scale[h] with per-head scales, a tuple of one per KV head, as vLLM's
    `k_scale` of shape [num_kv_heads]); values likewise with v_scale."""

    k_scale: Scale
    v_scale: Scale
    _tensors: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def per_head(self) -> bool:
        return isinstance(self.k_scale, tuple)

    def _as_tensor(self, which: str, like: torch.Tensor) -> torch.Tensor:
        """The per-head scales as a [kv_heads] tensor of `like`'s dtype and device (cached;
        powers of two, exact in every float format)."""
        key = (which, like.dtype, like.device)
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(getattr(self, which), dtype=like.dtype,
                                              device=like.device)
        return self._tensors[key]

    def attend(self, meta: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """`meta.attend` (the backend seam) over an fp8 cache, the scales folded in (module
        docstring): stores k / k_scale, v / v_scale (mutating the caches), returns the output.
        Per-head scales fold k_scale[h] into the queries of KV head h (q . k8 * s_h =
        (q * s_h) . k8) and v_scale[h] into their outputs."""
        if not self.per_head:
            out = meta.attend(q, k / self.k_scale, v / self.v_scale, k_cache, v_cache,
                              scale * self.k_scale, window)
            return out if self.v_scale == 1.0 else out.mul_(self.v_scale)
        ks, vs = self._as_tensor("k_scale", q), self._as_tensor("v_scale", q)
        t, heads, d = q.shape
        kvh = ks.shape[0]
        q_scaled = (q.view(t, kvh, heads // kvh, d) * ks.view(kvh, 1, 1)).view(t, heads, d)
        out = meta.attend(q_scaled, k / ks.view(kvh, 1), v / vs.view(kvh, 1), k_cache, v_cache,
                          scale, window)
        out.view(t, kvh, heads // kvh, d).mul_(vs.view(kvh, 1, 1))
        return out
