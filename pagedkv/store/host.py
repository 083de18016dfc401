"""HostTier: KV blocks in host RAM (vLLM's `kv_offloading_size` GiB), in a preallocated slot pool.

The tier owns one uint8 tensor [num_slots, block_bytes] allocated once (pinned memory when the
KV cache is on CUDA, so device<->host copies can be asynchronous), and a `KVCacheBlock` handle
per slot. Which slot is overwritten next is decided by an `EvictionPolicy` over those handles:
the block pool's own eviction interface (`pagedkv.kv.eviction`), LRU by default, so any policy
written for the pool plugs in here by name or factory. Every slot is always in the policy's
free set (a stored block is evictable at any time: readers copy it out under the tier's lock);
a slot holding a block carries the block's key as its `block_hash`, so the policy evicts
stored blocks after empty slots, least recently used first under LRU. A hit is `remove` +
`record_access` + `add`: the block becomes the most recently used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from pagedkv.events.wire import MEDIUM_HOST
from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.eviction import EvictionPolicy, eviction_policy_class
from pagedkv.store.payload import Payload, copy_payload_into, host_rows, payload_nbytes
from pagedkv.store.sizing import host_tier_blocks
from pagedkv.store.tier import KVTier

EvictionPolicyFactory = Callable[[list[KVCacheBlock]], EvictionPolicy]

def eviction_policy_factory(policy: str | EvictionPolicyFactory) -> EvictionPolicyFactory:
    """The pool's policy named `policy` (pagedkv.kv.eviction: lru, lfu, arc), or `policy`
    itself when it is a factory. Raises ValueError naming an unknown name."""
    return policy if callable(policy) else eviction_policy_class(policy)


class HostTier(KVTier):
    """At most `capacity_bytes // block_bytes` blocks of `block_bytes` bytes in host RAM."""

    name = "host"
    medium = MEDIUM_HOST

    def __init__(self, capacity_bytes: int, block_bytes: int, *, pin_memory: bool = False,
                 eviction_policy: str | EvictionPolicyFactory = "lru") -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"host tier capacity must be a positive byte count, "
                             f"got {capacity_bytes!r}")
        if not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive byte count, got {block_bytes!r}")
        num_slots = host_tier_blocks(capacity_bytes, block_bytes)
        if num_slots == 0:
            raise ValueError(f"host tier capacity {capacity_bytes} bytes holds no block of "
                             f"{block_bytes} bytes")
        factory = eviction_policy_factory(eviction_policy)
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.slots = host_rows(num_slots, block_bytes, pin_memory)
        self._slot_blocks = [KVCacheBlock(i) for i in range(num_slots)]
        self.policy = factory(list(self._slot_blocks))
        self._index: dict[bytes, KVCacheBlock] = {}  # key -> the slot holding it
        self._lock = threading.Lock()

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[Payload | None]:
        """Copies of the stored rows (uint8 tensors; valid after later writes), None for a miss."""
        out: list[Payload | None] = []
        with self._lock:
            for key in keys:
                slot = self._index.get(key)
                if slot is None:
                    out.append(None)
                    continue
                self._touch(slot)
                out.append(self.slots[slot.block_id].clone())
        return out

    def _touch(self, slot: KVCacheBlock) -> None:
        self.policy.remove([slot])
        self.policy.record_access([slot])
        self.policy.add([slot])

    def put_many(self, items: Sequence[tuple[bytes, Payload]]) -> list[bytes]:
        new: list[bytes] = []
        evicted: list[bytes] = []
        with self._lock:
            for key, payload in items:
                slot = self._index.get(key)
                if slot is not None:
                    self._touch(slot)
                    continue
                if payload_nbytes(payload) != self.block_bytes:
                    continue
                slot = self.policy.pop(1)[0]
                if slot.block_hash is not None:  # the policy's victim: evict its block
                    del self._index[slot.block_hash]
                    evicted.append(slot.block_hash)
                    slot.block_hash = None
                copy_payload_into(self.slots[slot.block_id], payload)
                slot.block_hash = key
                self._index[key] = slot
                self.policy.add([slot])
                new.append(key)
        if evicted:
            self._note_removed(evicted)
        return new

    def stored_keys(self) -> list[bytes]:
        """The keys held now (a snapshot)."""
        with self._lock:
            return list(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.block_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def capacity_blocks(self, block_bytes: int) -> int | None:
        return host_tier_blocks(self.capacity_bytes, block_bytes)

    def check_invariants(self) -> None:
        """Raise RuntimeError when the slots, the index and the policy disagree (tests)."""
        def fail(message: str) -> None:
            raise RuntimeError(f"host tier: {message}")

        with self._lock:
            self.policy.check_invariants(fail)
            free = self.policy.free_blocks()
            if len(free) != len(self._slot_blocks) or {id(b) for b in free} != {
                    id(b) for b in self._slot_blocks}:
                fail("the policy's free set is not exactly the slots")
            held = {b.block_hash: b for b in self._slot_blocks if b.block_hash is not None}
            if held.keys() != self._index.keys() or any(
                    held[k] is not s for k, s in self._index.items()):
                fail("the index does not match the slots' keys")
            if any(b.ref_cnt for b in self._slot_blocks):
                fail("a slot has a reference count")

