"""KVCache.read_blocks / write_blocks: a block crosses the store seam as one row of raw bytes
holding every layer's K and V of that block, whatever the cache's layout."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kv.spec import FullAttentionSpec
from pagedkv.model.kv_cache import KVCache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_rows_round_trip(dtype):
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=3, dtype=dtype, num_layers=2)
    src = KVCache.from_spec(spec, num_blocks=6, device=torch.device("cpu"))
    src.kv.normal_()
    rows = src.read_blocks([2, 5, 1])
    assert rows.dtype == torch.uint8 and rows.shape == (3, spec.page_size_bytes)
    block = src.kv.select(KVCache.BLOCK_DIM, 5)  # [layers, 2, heads, block_size, head_dim]
    assert torch.equal(rows[1].view(src.kv.dtype), block.flatten())
    before = rows.clone()
    src.kv.zero_()
    assert torch.equal(rows, before)  # a copy, not a view of the cache
    dst = KVCache.from_spec(spec, num_blocks=6, device=torch.device("cpu"))
    dst.write_blocks([4, 1, 3], before)
    src_again = before.view(src.kv.dtype).view(3, 2, 2, 2, 4, 3)
    for i, block_id in enumerate([4, 1, 3]):
        assert torch.equal(dst.kv.select(KVCache.BLOCK_DIM, block_id), src_again[i])
    for untouched in (0, 2, 5):
        assert not dst.kv.select(KVCache.BLOCK_DIM, untouched).any()


def test_block_rows_reject_bad_input():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2, dtype="float32",
                             num_layers=1)
    cache = KVCache.from_spec(spec, num_blocks=3, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="out of range"):
        cache.read_blocks([3])
    with pytest.raises(ValueError, match="rows must be uint8"):
        cache.write_blocks([1], torch.zeros((2, spec.page_size_bytes), dtype=torch.uint8))
    with pytest.raises(ValueError, match="rows must be uint8"):
        cache.write_blocks([1], torch.zeros((1, spec.page_size_bytes // 4)))
    with pytest.raises(ValueError, match=rf"\[1, {spec.page_size_bytes}\]"):
        cache.write_blocks([1], torch.zeros((1, spec.page_size_bytes - 4), dtype=torch.uint8))
