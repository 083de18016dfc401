"""The kv-aware policy (`pagedkv.engine.placement.kv_aware`, where its cost is documented)."""

from __future__ import annotations

from pagedkv.engine.placement.kv_aware import (
    KVAwarePolicy,
    KVAwareWeights,
    cost,
    new_blocks,
    overloaded,
)

__all__ = ["KVAwarePolicy", "KVAwareWeights", "cost", "new_blocks", "overloaded"]
