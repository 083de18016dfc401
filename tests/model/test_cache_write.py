"""The fused KV write (kernels/csrc/cache_write.cpp's write_kv_): each token's K and V rows land
in their slots exactly, from strided views of one qkv tensor, across blocks out of order, with
padding slots (-1) skipped and every other slot untouched."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_puts_each_row_in_its_slot_and_skips_padding(dtype):
    assert ensure_cpu_kernels("wait")
    gen = torch.Generator().manual_seed(0)
    kv_heads, d, bs, blocks, tokens = 3, 40, 8, 24, 150
    qkv = torch.randn(tokens, 4 + 2 * kv_heads, d, generator=gen).to(dtype)
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]  # strided rows, contiguous heads
    order = torch.randperm(blocks, generator=gen)
    slots = (order[:, None] * bs + torch.arange(bs)).reshape(-1)[:tokens].clone()
    slots[[3, 77, 149]] = -1
    k_cache = torch.full((kv_heads, blocks, bs, d), 9.0, dtype=dtype)
    v_cache = k_cache.clone()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kept = slots >= 0
    for want, x in ((want_k, k), (want_v, v)):
        want.view(kv_heads, -1, d)[:, slots[kept]] = x[kept].transpose(0, 1)
    torch.ops.pagedkv_cpu.write_kv_(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert int((k_cache == 9.0).all(-1).sum()) == kv_heads * (blocks * bs - int(kept.sum()))


def test_write_kv_refuses_a_slot_past_the_cache():
    assert ensure_cpu_kernels("wait")
    x = torch.zeros(2, 1, 8)
    cache = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="slot 8 >= 8"):
        torch.ops.pagedkv_cpu.write_kv_(x, x, cache, cache.clone(), torch.tensor([0, 8]))
