"""The dashboard's page-state model: the block state rebuilt from the op stream alone.

This is the Python twin of the page's JavaScript model (static/state.js applies the same ops the
same way); tests replay random pool operations through the stream into it and compare it with
the pool's own `pool_snapshot` (pagedkv.kv.observer). Pure data: imports nothing from the engine.

Per pool: `refs[id]`, `hashes[id]` (short hex or None), `free_order` (the free blocks that carry
a hash, in the order they became free: the LRU eviction order, rank 0 evicted next; replaced
whole by an "o" op under LFU and ARC, whose order the ref ops do not show) and `pins`.
The prefix forest (device pool) maps each cached hash to its parent hash, its block, how many
times a request took a reference on it (hits) and when (the batch time) it was last used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PrefixNode:
    """One cached block in the prefix forest."""

    parent: str | None
    block_id: int
    hits: int = 0
    last_use: float = 0.0


class PoolState:
    """One pool's blocks as the stream describes them."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        self.refs: list[int] = list(snapshot["refs"])
        self.hashes: list[str | None] = list(snapshot["hashes"])
        self.free_order: dict[int, None] = dict.fromkeys(snapshot["free_order"])
        self.pins: dict[int, int] = {int(k): v for k, v in snapshot.get("pins", {}).items()}

    def snapshot(self) -> dict[str, Any]:
        """The same shape as `pagedkv.kv.observer.pool_snapshot`."""
        return {"num_blocks": len(self.refs), "refs": list(self.refs),
                "hashes": list(self.hashes), "free_order": list(self.free_order),
                "pins": dict(self.pins)}

    def counts(self) -> dict[str, int]:
        """Blocks by state, null block excluded: free (no hash), cached (free with a hash:
        evictable), in_use (ref > 0, pins included) and pinned."""
        in_use = sum(1 for r in self.refs[1:] if r > 0)
        cached = len(self.free_order)
        return {"free": len(self.refs) - 1 - in_use - cached, "cached": cached,
                "in_use": in_use, "pinned": len(self.pins)}


class PageState:
    """All pools plus the device prefix forest; `apply` mutates them in place."""

    def __init__(self, snapshots: list[dict[str, Any]]) -> None:
        self.pools = [PoolState(s) for s in snapshots]
        self.forest: dict[str, PrefixNode] = {}
        device = self.pools[0]
        for block_id, block_hash in enumerate(device.hashes):
            if block_hash is not None:
                self.forest[block_hash] = PrefixNode(None, block_id)

    def apply(self, ops: list[list[Any]], now: float = 0.0) -> None:
        """Apply one batch of ops (see `BlockOpRecorder`); `now` stamps the nodes it uses."""
        forest = self.forest
        for kind, pool_index, data in ops:
            pool = self.pools[pool_index]
            refs, hashes, order = pool.refs, pool.hashes, pool.free_order
            if kind == "r":
                for i in range(0, len(data), 2):
                    block_id, ref = data[i], data[i + 1]
                    old = refs[block_id]
                    refs[block_id] = ref
                    block_hash = hashes[block_id]
                    if old == 0 and ref > 0:
                        order.pop(block_id, None)
                    elif old > 0 and ref == 0 and block_hash is not None:
                        order[block_id] = None
                    if ref > old and block_hash is not None and pool_index == 0:
                        node = forest.get(block_hash)
                        if node is not None:
                            node.hits += 1
                            node.last_use = now
            elif kind in ("e", "u"):
                for block_id in data:
                    block_hash = hashes[block_id]
                    hashes[block_id] = None
                    order.pop(block_id, None)
                    if pool_index == 0 and block_hash is not None:
                        forest.pop(block_hash, None)
            elif kind == "c":
                for i in range(0, len(data), 3):
                    block_id, block_hash, parent = data[i], data[i + 1], data[i + 2]
                    hashes[block_id] = block_hash
                    if refs[block_id] == 0:
                        order[block_id] = None
                    if pool_index == 0:
                        forest[block_hash] = PrefixNode(parent, block_id, 0, now)
            elif kind == "x":
                for block_id in range(len(hashes)):
                    hashes[block_id] = None
                order.clear()
                if pool_index == 0:
                    forest.clear()
            elif kind == "p":
                for i in range(0, len(data), 2):
                    if data[i + 1]:
                        pool.pins[data[i]] = data[i + 1]
                    else:
                        pool.pins.pop(data[i], None)
            elif kind == "o":
                pool.free_order = dict.fromkeys(data)
            else:
                raise ValueError(f"unknown dashboard op {kind!r}")

    def eviction_rank(self, pool_index: int = 0) -> dict[int, int]:
        """{block_id: rank} of the cached free blocks (0 is evicted next)."""
        return {b: r for r, b in enumerate(self.pools[pool_index].free_order)}
