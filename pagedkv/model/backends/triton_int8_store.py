"""The int8 KV store as one Triton launch: per token and KV head, kv_int8's scale search (the
least squared round-trip error of the SCALE_FACTORS candidates times max|x| / 127), the
quantization and the write of the int8 row and its scale into the paged cache through the slot
mapping, for keys and values together.

Bit-identical to kv_int8.quantize_into_per_token (the torch write) and to the C++ write
(csrc/cache_write.cpp, write_kv_int8_): divisions correctly rounded (`div_rn`, not the GPU's fast
approximate division), rounding half to even built from `floor` (exact below 2^22, so in
float64 too), the squared errors counted in the same integers (kv_int8._squared_errors: x - q s
exact in float64, in units of 2^-(ERROR_BITS + 1) of the power of two of max|x| / 127), ties to
the first (smallest) candidate. No data-dependent shapes: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.model.kv_int8 import ERROR_BITS, SCALE_FACTORS, SCALE_FIRST, SCALE_STEP


@triton.jit
def _round_half_even(y):
    """y (float32 or float64, |y| < 2^22) rounded to the nearest integer, ties to even (as
    torch.round), as y's dtype."""
    r = tl.floor(y)
    frac = y - r  # exact: r and y share y's exponent range
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def _frexp_exponent(v):
    """e with v = m 2^e, m in [0.5, 1), of a positive float32 scalar v (subnormals too)."""
    tiny = v < 1.1754943508222875e-38  # below the smallest normal float32: scaled by 2^64 first
    scaled = v * tl.where(tiny, 18446744073709551616.0, 1.0)
    biased = (scaled.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return biased - 126 - tl.where(tiny, 64, 0)


@triton.jit
def _load_float32(ptr, offs, mask):
    """The values at ptr + offs (masked: 0) as float32, exactly: bfloat16 widened from its bits
    (a 16-bit shift, as the GPU converts; Triton's interpreter would flush its subnormals)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_int8_row(x_ptr, cache_ptr, scale_ptr, offs_d, d_ok,
                    NUM_CANDIDATES: tl.constexpr, FIRST: tl.constexpr, STEP: tl.constexpr,
                    ERROR_BITS: tl.constexpr):
    """One vector x (HEAD_DIM values at x_ptr + offs_d) as int8 at cache_ptr + offs_d and its
    scale at scale_ptr (both written), kv_int8.quantize_per_token's choice."""
    x = _load_float32(x_ptr, offs_d, d_ok)
    base = tl.math.div_rn(tl.max(tl.abs(x), 0), 127.0)
    safe = tl.where(base > 0.0, base, 1.0)
    power = ERROR_BITS + 1 - _frexp_exponent(safe)
    unit = ((power + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^power
    c = tl.arange(0, NUM_CANDIDATES)
    cand = safe * (1.0 + (c + FIRST).to(tl.float32) * STEP)  # exact factors, one rounding
    q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x[None, :], cand[:, None])),
                              -127.0), 127.0)
    diff = x.to(tl.float64)[None, :] - q.to(tl.float64) * cand.to(tl.float64)[:, None]
    units = _round_half_even(diff * unit).to(tl.int64)
    err = tl.sum(units * units, 1)
    best = tl.min(tl.where(err == tl.min(err, 0), c, NUM_CANDIDATES), 0)  # the first of equals
    s = tl.sum(tl.where(c == best, cand, 0.0), 0)
    row = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, s)), -127.0), 127.0)
    tl.store(cache_ptr + offs_d, row.to(tl.int8), mask=d_ok)
    tl.store(scale_ptr, tl.where(base > 0.0, s, 0.0))


@triton.jit
def store_kv_int8_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                         slot_mapping_ptr, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                         stride_cache_h, stride_scale_h, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, NUM_CANDIDATES: tl.constexpr,
                         FIRST: tl.constexpr, STEP: tl.constexpr, ERROR_BITS: tl.constexpr):
    """Program (t, h) stores token t's key and value of KV head h into slot slot_mapping[t]
    (int8 rows and their scales); a negative slot (a padding token) is skipped."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    row = h * stride_cache_h + slot * HEAD_DIM
    scale = h * stride_scale_h + slot
    _store_int8_row(k_ptr + t * stride_k_t + h * stride_k_h, k_cache_ptr + row,
                    k_scale_ptr + scale, offs_d, d_ok, NUM_CANDIDATES, FIRST, STEP, ERROR_BITS)
    _store_int8_row(v_ptr + t * stride_v_t + h * stride_v_h, v_cache_ptr + row,
                    v_scale_ptr + scale, offs_d, d_ok, NUM_CANDIDATES, FIRST, STEP, ERROR_BITS)


def store_kv_int8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] (any float dtype; strided, last dim contiguous) as
    int8 into slots `slot_mapping` [T] of k_cache / v_cache [kv_heads, num_blocks, block_size,
    head_dim] (int8, contiguous) and their scales into k_scales / v_scales [kv_heads,
    num_blocks, block_size] (float32, contiguous); all four mutated. Slot -1: skipped."""
    t, kvh, d = k.shape
    if t == 0:
        return
    store_kv_int8_kernel[(t, kvh)](
        k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_cache.stride(0), k_scales.stride(0), HEAD_DIM=d,
        HEAD_DIM_PAD=triton.next_power_of_2(d), NUM_CANDIDATES=len(SCALE_FACTORS),
        FIRST=SCALE_FIRST, STEP=SCALE_STEP, ERROR_BITS=ERROR_BITS)
