"""What `pagedkv plan` says about KV cache groups: blocks and bytes per group for one sequence,
against the layout that keeps every layer's full-attention blocks (hybrid_spec.py)."""

from __future__ import annotations

from typing import Any

from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.utils import cdiv


def group_rows(spec: KVCacheSpec, max_model_len: int) -> dict[str, Any] | None:
    """Per group (index, kind, window, layers, resident blocks and bytes of one sequence of
    `max_model_len` tokens), the total, and the all-full layout's bytes for the same sequence
    (every model layer keeping every block); None for a single-group spec."""
    if not isinstance(spec, HybridKVCacheSpec):
        return None
    page = spec.page_size_bytes
    groups = []
    for g in spec.groups:
        blocks = g.spec.max_blocks_per_seq(max_model_len)
        groups.append({"group_idx": g.group_idx, "kind": g.spec.kind,
                       "sliding_window": g.sliding_window, "layers": list(g.layer_ids),
                       "blocks_per_seq": blocks, "bytes_per_seq": blocks * page})
    layer_page = page // spec.num_layers  # one layer's block
    all_full = cdiv(max_model_len, spec.block_size) * spec.num_model_layers * layer_page
    total = sum(g["bytes_per_seq"] for g in groups)
    return {"kv_cache_groups": groups, "kv_bytes_per_seq": total,
            "all_full_kv_bytes_per_seq": all_full,
            "saving_vs_all_full": round(all_full / total, 2)}
