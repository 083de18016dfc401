"""Sub-block prefix hits (vLLM's `prefix_match_unit`): reuse the matching part of a cached block.

The prefix cache keys full blocks by their chained hash, so a hit stops at the last full block:
a shared prefix of 1,000 tokens with 32-token blocks reuses 992. With a match unit `u` (a
divisor of the block size; 1 = token granularity) the hit may go on into one more block: the
first `m` tokens (a multiple of `u`) of a cached block that hangs off the same parent and
starts with the request's next tokens. The request gets a fresh block with a copy of that
block (copy-on-write, applied by the runner before the step) and writes its own tokens after
position `m`; the cached block stays as it was.

Candidates come from a secondary index beside the chained hashes (which keep their meaning for
events and the store): parent key -> {pool key: the block's tokens}, where the parent key is
the previous block's hash (or, for block 0, the request's first-block extra keys: salt, LoRA).
It lists every full block the manager caches and the partial last block of every request
freed with at least `u` computed tokens in it, which is registered in the pool under a key of
its own (`partial_block_key`: evicted like any cached block, without events). Entries are
checked against the pool on use, so an evicted block is never offered.

With KV cache groups (coordinator.py) every group has an index of its own blocks (keys carry
the group's suffix; parent keys are the plain hashes, alike in every group), and a sub-block
hit needs a matching block in every group: see `HybridKVCacheManager.get_computed_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import (
    NONE_HASH,
    BlockHash,
    HashFn,
    encode_extra_keys,
    request_extra_keys,
)

_PARTIAL_MARK = b"pagedkv/partial-block/v1"


def check_prefix_match_unit(unit: int | None, block_size: int) -> None:
    """ValueError unless `unit` is None or a positive divisor of `block_size`."""
    if unit is None:
        return
    if not isinstance(unit, int) or isinstance(unit, bool) or unit <= 0 \
            or block_size % unit:
        raise ValueError(f"prefix_match_unit must be a positive divisor of block_size "
                         f"({block_size}), got {unit!r}")


def first_parent_key(cache_salt: str | None, lora_name: str | None) -> BlockHash:
    """The parent key of a request's block 0: its first-block extra keys."""
    return NONE_HASH + encode_extra_keys(request_extra_keys(cache_salt, lora_name, True))


class PartialPrefixIndex:
    """Parent key -> candidate blocks (their pool key and tokens); see the module docstring."""

    def __init__(self, pool: BlockPool, hash_fn: HashFn, block_size: int, unit: int,
                 key_suffix: bytes = b"") -> None:
        """`key_suffix`: the KV cache group's key suffix (hashing.group_key_suffix), so the
        partial blocks of groups sharing one pool never share a key."""
        check_prefix_match_unit(unit, block_size)
        self.pool = pool
        self.key_suffix = key_suffix
        self.hash_fn = hash_fn
        self.block_size = block_size
        self.unit = unit
        self._children: dict[BlockHash, dict[BlockHash, tuple[int, ...]]] = {}

    def add(self, parent: BlockHash, key: BlockHash, tokens: Sequence[int]) -> None:
        """Offer the block cached under `key` (holding `tokens`) as a child of `parent`."""
        self._children.setdefault(parent, {})[key] = tuple(tokens)

    def add_partial(self, parent: BlockHash, block: KVCacheBlock, tokens: Sequence[int]) -> None:
        """Register a freed request's partial last block (already unreferenced or about to be):
        cached in the pool under its own key, unless a block with that content already is."""
        if len(tokens) < self.unit or block.is_null or block.block_hash is not None:
            return
        key = self.hash_fn(_PARTIAL_MARK + parent + encode_extra_keys(
            (("tokens", ",".join(map(str, tokens))),))) + self.key_suffix
        if key in self.pool.cached_block_hash_to_block:
            return
        self.pool.cache_untracked(block, key)
        self.add(parent, key, tokens)

    def find(self, parent: BlockHash, tokens: Sequence[int],
             max_tokens: int) -> tuple[KVCacheBlock | None, int]:
        """The cached child of `parent` whose tokens share the longest prefix with `tokens`,
        and that length rounded down to the unit (at most `max_tokens`); (None, 0) if under
        one unit. Drops entries whose block was evicted."""
        children = self._children.get(parent)
        if not children or max_tokens < self.unit:
            return None, 0
        cached = self.pool.cached_block_hash_to_block
        best, best_len, stale = None, 0, []
        limit = min(max_tokens, len(tokens), self.block_size)
        for key, block_tokens in children.items():
            block = cached.get(key)
            if block is None:
                stale.append(key)
                continue
            n = 0
            end = min(limit, len(block_tokens))
            while n < end and block_tokens[n] == tokens[n]:
                n += 1
            if n > best_len:
                best, best_len = block, n
        for key in stale:
            del children[key]
        if not children:
            del self._children[parent]
        best_len -= best_len % self.unit
        return (best, best_len) if best_len else (None, 0)
