"""Prefix caching for KVCacheManager: finding a request's cached prefix and registering its
full blocks (and, with sub-block hits, its partial ones) in the pool's prefix cache.

A mixin over the manager's per-request state (`_reqs`), pool, hasher and sub-block index
(partial_hits.py); the contract of each public call is in interface.py.
"""

from __future__ import annotations

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.hashing import BlockHash, RequestBlockHasher
from pagedkv.kv.partial_hits import PartialPrefixIndex, first_parent_key
from pagedkv.kv.request_blocks import KVRequest, PrefixCacheStats, RequestBlocks


class PrefixCacheMixin:
    """KVCacheManager's prefix-cache lookups and registration (see the module docstring)."""

    _reqs: dict[str, RequestBlocks]
    pool: BlockPool
    block_size: int
    enable_caching: bool
    hasher: RequestBlockHasher
    partial_index: PartialPrefixIndex | None
    prefix_cache_stats: PrefixCacheStats
    _key_suffix: bytes

    def drop_partial_hit(self, computed_blocks: list[KVCacheBlock], num_hit_tokens: int
                         ) -> tuple[list[KVCacheBlock], int]:
        if not num_hit_tokens % self.block_size:
            return computed_blocks, num_hit_tokens
        return computed_blocks[:-1], num_hit_tokens - num_hit_tokens % self.block_size

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_caching:
            return [], 0
        num_tokens = request.num_tokens
        bs = self.block_size
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = RequestBlocks()
        block_hashes = state.block_hashes
        if len(block_hashes) < num_tokens // bs:
            self.hasher(request, block_hashes)
        max_blocks = (num_tokens - 1) // bs
        get = self.pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        append = hits.append
        for block_hash in (block_hashes if len(block_hashes) <= max_blocks
                           else block_hashes[:max_blocks]):
            block = get(block_hash)
            if block is None:
                break
            append(block)
        num_hit_tokens = len(hits) * self.block_size
        if self.partial_index is not None:  # go on into the next block, unit by unit
            block, m = self.partial_index.find(
                self._parent_key(request, block_hashes, len(hits)),
                request.all_token_ids[num_hit_tokens:], num_tokens - 1 - num_hit_tokens)
            if block is not None:
                hits.append(block)
                num_hit_tokens += m
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        state = self._reqs.get(request.request_id)
        if state is None or state.host_blocks is not None:
            return
        self._cache_blocks(request, state, min(num_computed_tokens, request.num_tokens))

    def _cache_blocks(self, request: KVRequest, state: RequestBlocks, num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        if num_full > len(state.blocks):
            num_full = len(state.blocks)
        num_cached = state.num_cached_blocks
        if num_full <= num_cached:
            return
        hashes = state.block_hashes
        if len(hashes) < num_full:
            self.hasher(request, hashes)
        if self._key_suffix:  # a hybrid group's keys (the pool's events name the plain hash)
            suffix = self._key_suffix
            hashes = [h + suffix for h in hashes[:num_full]]
        self.pool.cache_full_blocks(state.blocks, hashes, num_cached, num_full, self.block_size,
                                    request.all_token_ids, cache_salt=request.cache_salt,
                                    lora_name=request.lora_name)
        if self.partial_index is not None:  # full blocks are sub-block hit candidates too
            self._offer_full_blocks(request, state, num_cached, num_full)
        state.num_cached_blocks = num_full

    def _parent_key(self, request: KVRequest, hashes: list[BlockHash], i: int) -> BlockHash:
        """Key of block i's parent in the sub-block index (partial_hits.py)."""
        return hashes[i - 1] if i else first_parent_key(request.cache_salt, request.lora_name)

    def _offer_full_blocks(self, request: KVRequest, state: RequestBlocks, start: int,
                           end: int) -> None:
        bs, hashes, tokens = self.block_size, state.block_hashes, request.all_token_ids
        suffix = self._key_suffix
        for i in range(start, end):
            key = hashes[i] + suffix
            if state.blocks[i].block_hash == key:
                self.partial_index.add(self._parent_key(request, hashes, i), key,
                                       tokens[i * bs:(i + 1) * bs])

    def _offer_partial_tail(self, request: KVRequest, state: RequestBlocks) -> None:
        """Offer the request's partly filled last computed block to sub-block hits."""
        bs = self.block_size
        computed = min(request.num_computed_tokens, request.num_tokens)
        i, m = divmod(computed, bs)
        if m and i < len(state.blocks) and state.blocks[i].ref_cnt == 1:  # nobody else writes
            if len(state.block_hashes) < i:
                self.hasher(request, state.block_hashes)
            if len(state.block_hashes) >= i:
                self.partial_index.add_partial(self._parent_key(request, state.block_hashes, i),
                                               state.blocks[i],
                                               request.all_token_ids[i * bs:computed])
