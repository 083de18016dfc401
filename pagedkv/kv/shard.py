"""One tensor-parallel rank's share of the KV cache: the same blocks, its own KV heads.

Every rank caches the KV heads its query heads read (an even share, or one replicated head
when the model has fewer KV heads than ranks), so a rank's bytes per block, what the planner
counts, are `shard_kv_cache_spec(spec, size).page_size_bytes`. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import replace

from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.spec import FullAttentionSpec, KVCacheSpec


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each of `size` ranks holds (and caches): an even share, or 1 when fewer."""
    return max(1, num_kv_heads // size)


def shard_kv_cache_spec(spec: KVCacheSpec, size: int) -> KVCacheSpec:
    """The KV cache spec of one of `size` ranks (`spec` itself for one rank)."""
    if size == 1:
        return spec
    if not isinstance(spec, FullAttentionSpec):
        raise ValueError(f"tensor parallelism has no sharding for a {spec.kind!r} KV cache")
    heads = local_kv_heads(spec.num_kv_heads, size)
    if isinstance(spec, HybridKVCacheSpec):  # every group's spec too (they size the blocks)
        return replace(spec, num_kv_heads=heads, groups=tuple(
            replace(g, spec=replace(g.spec, num_kv_heads=heads)) for g in spec.groups))
    return replace(spec, num_kv_heads=heads)
