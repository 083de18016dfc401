"""The in-place quantized decode kernel against a pure-torch reference, in one function a test
can also run in a subprocess built with PAGEDKV_CPU_ISA=avx2 (tests/model/test_kv_int8.py).

`check_quantized_decode()` fills int8 (with per-token scales), fp8 and model-dtype caches with
random K/V, for head sizes 64 and 128 (the kernel's compile-time-size path) and 80 (its general
path), runs `torch.ops.pagedkv_cpu.paged_decode_attention_q` for sequences of several lengths
(partial last blocks, a sliding-window start, a block table padded with the null block) and
compares each output with softmax attention over the dequantized keys and values. The last
CHUNK_ROWS rows are the tokens of one prefill chunk (one block table, consecutive lengths, some
with a sliding-window start), after two decodes sharing the chunk's first two blocks: the kernel
takes such rows in tiles that share each block's loads (more rows than one tile, a tile
boundary mid-block, rows past the shared blocks reading their own). Returns the largest relative error per
(cache dtype, q dtype); raises AssertionError past the tolerance.
"""

from __future__ import annotations

import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.kv_int8 import dequantize_per_token, quantize_per_token
from pagedkv.model.kv_quant import dequantize, quantize

KV_HEADS, HEADS, BLOCK, NUM_BLOCKS = 2, 6, 16, 24
# The chunk's rows: positions 27 .. 27 + CHUNK_ROWS - 1 of a 4-block sequence; the rows from
# CHUNK_WINDOW_ROW on attend through a 20-token sliding window.
CHUNK_START, CHUNK_ROWS, CHUNK_WINDOW_ROW, CHUNK_WINDOW = 27, 21, 12, 20
HEAD_DIMS = (64, 80, 128)  # 80: the general path, with a vector tail of 16 lanes
# Max |error| relative to the largest |output|: float32 summation order and fast_exp's 2 ulp;
# a bfloat16 output's rounding.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# An int8 cache's q . k is taken in integers against q rounded to int16 (2^-15 of the head's
# largest |q|, 256x finer than q's own bfloat16 rounding): a float32 q sees that rounding.
INT8_FLOAT32_TOLERANCE = 1e-4


def _reference(q, keys, values, tables, first, lens, scale):
    """Softmax attention of each row's query heads (HEADS // KV_HEADS per KV head) over its
    sequence's keys and values from positions `first` to `lens`, in float32."""
    head_dim = q.shape[-1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    g = HEADS // KV_HEADS
    for s, (table, start, n) in enumerate(zip(tables, first, lens, strict=True)):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, n)])
        k = keys.reshape(KV_HEADS, -1, head_dim)[:, slots]  # [kv heads, tokens, head_dim]
        v = values.reshape(KV_HEADS, -1, head_dim)[:, slots]
        qs = q[s].float().reshape(KV_HEADS, g, head_dim)  # head h reads KV head h // g
        w = torch.softmax(qs @ k.transpose(1, 2) * scale, dim=-1)  # [kv heads, g, tokens]
        out[s] = (w @ v).reshape(HEADS, head_dim)
    return out


def check_quantized_decode(seed: int = 0) -> dict[str, float]:
    """Max relative error of the kernel per "cache/q dtype/head size" (see the module
    docstring)."""
    ensure_cpu_kernels("wait")
    errors = {}
    for head_dim in HEAD_DIMS:
        errors.update(_check_head_dim(head_dim, seed))
    return errors


def _check_head_dim(head_dim: int, seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, NUM_BLOCKS, BLOCK, head_dim)
    raw_k = torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 4
    raw_v = torch.randn(shape, generator=gen)
    lens, first = [1, 37, 100, 64], [0, 0, 60, 0]  # 60: a sliding window starting mid-block
    perm = torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1
    tables, i = [], 0
    for n in lens:
        need = -(-n // BLOCK)
        tables.append(perm[i:i + need].tolist())
        i += need
    chunk_table = perm[i:i + 4].tolist()
    for n, own in ((40, perm[i + 4:i + 5]), (60, perm[i + 5:i + 7])):  # decodes sharing a prefix
        lens.append(n)
        first.append(0)
        tables.append(chunk_table[:2] + own.tolist())
    for r in range(CHUNK_ROWS):  # one row per token of the chunk, all on one block table
        n = CHUNK_START + r + 1
        lens.append(n)
        first.append(max(0, n - CHUNK_WINDOW) if r >= CHUNK_WINDOW_ROW else 0)
        tables.append(chunk_table)
    width = max(len(t) for t in tables)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    errors = {}
    (k_int8, k_scales), (v_int8, v_scales) = quantize_per_token(raw_k), quantize_per_token(raw_v)
    for cache_dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, None):
        for q_dtype in (torch.float32, torch.bfloat16):
            if cache_dtype == torch.int8:  # quantized once: the same blocks for both q dtypes
                k8, ks, v8, vs = k_int8, k_scales, v_int8, v_scales
                keys, values = dequantize_per_token(k8, ks, torch.float32), \
                    dequantize_per_token(v8, vs, torch.float32)
            elif cache_dtype is None:  # the model-dtype cache
                k8, v8, ks, vs = raw_k.to(q_dtype), raw_v.to(q_dtype), None, None
                keys, values = k8.float(), v8.float()
            else:
                k8, v8, ks, vs = quantize(raw_k, cache_dtype), quantize(raw_v, cache_dtype), None, None
                keys, values = dequantize(k8, torch.float32), dequantize(v8, torch.float32)
            q = torch.randn(len(lens), HEADS, head_dim, generator=gen).to(q_dtype)
            out = torch.empty_like(q)
            scale = head_dim ** -0.5
            torch.ops.pagedkv_cpu.paged_decode_attention_q(
                q, k8, v8, ks, vs, table_tensor, torch.tensor(first), torch.tensor(lens), scale,
                out, None)
            ref = _reference(q, keys, values, tables, first, lens, scale)
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            cache_name = "model dtype" if cache_dtype is None else str(cache_dtype)
            name = (f"{cache_name.removeprefix('torch.')}/{str(q_dtype).removeprefix('torch.')}"
                    f"/{head_dim}")
            errors[name] = err
            tol = TOLERANCE[q_dtype]
            if cache_dtype == torch.int8 and q_dtype == torch.float32:
                tol = INT8_FLOAT32_TOLERANCE
            assert err <= tol, (name, err)
    return errors
