"""The fused CPU decode attention kernel (`paged_decode_attention`) against float64.

For each dtype, head size and query group the check returns the ratio of the kernel's worst
error against a float64 computation to the error bound of a float32 reference's rounding
(`ratio <= 1`: the kernel is as close to exact as its dtype allows). The sequences' lengths
leave partial blocks and partial 16-row groups, some start past their first keys (a window),
two share their first blocks (a tile read once for both), and the blocks lie scattered in the
cache (each next block prefetched from its own place). Runs in this process or in a child
built for another instruction set (isa_child.run_with_isa).
"""

from __future__ import annotations

import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels, panel_isa

LENS = (1, 15, 16, 17, 33, 50, 100, 100)  # the last two share their first four blocks
FIRST = (0, 0, 3, 0, 17, 5, 40, 0)  # first key position attended (a window's start)
BLOCK = 16
SHARED_BLOCKS = 4


def _tables(gen: torch.Generator, num_blocks: int) -> torch.Tensor:
    """Block tables [S, W] of scattered blocks (the last two rows share their first blocks)."""
    width = -(-max(LENS) // BLOCK)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: width * len(LENS)]
    tables = ids.view(len(LENS), width).clone()
    tables[-1, :SHARED_BLOCKS] = tables[-2, :SHARED_BLOCKS]
    return tables


def _exact(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           tables: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Attention of each row over its keys FIRST[s] .. LENS[s] - 1, in `dtype` (float64:
    exact; float32: the reference whose rounding sets the bound)."""
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = torch.empty(q.shape, dtype=dtype)
    for s, (first, n) in enumerate(zip(FIRST, LENS, strict=True)):
        pos = torch.arange(first, n)
        slots = tables[s, pos // BLOCK] * BLOCK + pos % BLOCK
        k = k_cache.flatten(1, 2)[:, slots].to(dtype)  # [KVH, n, D]
        v = v_cache.flatten(1, 2)[:, slots].to(dtype)
        qs = q[s].to(dtype).view(kv_heads, heads // kv_heads, -1)
        weights = torch.softmax(qs @ k.transpose(1, 2) * scale, dim=-1)
        out[s] = (weights @ v).reshape(heads, -1)
    return out


def check_decode_kernel(seed: int = 0) -> dict:
    """{"isa": the build's panel path, "<dtype> D<head size> <heads>/<kv heads>": worst ratio
    (see the module docstring)}."""
    assert ensure_cpu_kernels("wait")
    out: dict = {"isa": panel_isa()}
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (64, 128):
            for heads, kv_heads in ((8, 4), (4, 4), (6, 2)):
                shape = (kv_heads, num_blocks, BLOCK, head_dim)
                k_cache = torch.randn(shape, generator=gen).to(dtype)
                v_cache = torch.randn(shape, generator=gen).to(dtype)
                q = torch.randn(len(LENS), heads, head_dim, generator=gen).to(dtype)
                tables = _tables(gen, num_blocks)
                scale = head_dim ** -0.5
                got = torch.empty_like(q)
                torch.ops.pagedkv_cpu.paged_decode_attention(
                    q, k_cache, v_cache, tables, torch.tensor(FIRST), torch.tensor(LENS),
                    scale, got, None)
                exact = _exact(q, k_cache, v_cache, tables, scale, torch.float64)
                ref = _exact(q, k_cache, v_cache, tables, scale, torch.float32).to(dtype)
                ulp = torch.finfo(dtype).eps * float(exact.abs().max())
                bound = 2 * float((ref.double() - exact).abs().max()) + ulp
                name = str(dtype).removeprefix("torch.")
                out[f"{name} D{head_dim} {heads}/{kv_heads}"] = \
                    float((got.double() - exact).abs().max()) / bound
    return out
