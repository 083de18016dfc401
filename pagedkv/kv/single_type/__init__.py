"""Per-attention-type block rules of the KV manager, chosen from the KV cache spec (as vLLM's
single_type_kv_cache_manager.py): `FullAttentionPolicy` keeps every block of a sequence;
`SlidingWindowPolicy` frees the blocks that fell out of the window. A new attention type (say,
chunked local attention) is a new file with a `BlockTablePolicy` subclass and a line here.
"""

from __future__ import annotations

from pagedkv.kv.single_type.base import BlockTablePolicy
from pagedkv.kv.single_type.full_attention import FullAttentionPolicy
from pagedkv.kv.single_type.sliding_window import SlidingWindowPolicy
from pagedkv.kv.spec import KVCacheSpec, SlidingWindowSpec


def block_table_policy(block_size: int, sliding_window: int | None = None) -> BlockTablePolicy:
    """The policy for a cache whose every layer slides over `sliding_window` tokens (None:
    full attention, also when only some layers slide: they keep full-attention blocks)."""
    if sliding_window is None:
        return FullAttentionPolicy(block_size)
    return SlidingWindowPolicy(block_size, sliding_window)


def block_table_policy_for_spec(spec: KVCacheSpec) -> BlockTablePolicy:
    """The policy a KV cache spec calls for."""
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    return block_table_policy(spec.block_size, window)


__all__ = ["BlockTablePolicy", "FullAttentionPolicy", "SlidingWindowPolicy",
           "block_table_policy", "block_table_policy_for_spec"]
