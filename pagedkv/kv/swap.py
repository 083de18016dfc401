"""Swap preemption for KVCacheManager: a request's device blocks copied to host blocks and back.

A mixin over the manager's per-request state (`_reqs`), pools and prefix cache: swap-out frees
the device blocks tail first (cached ones stay cached); swap-in takes blocks still cached on the
device from the prefix cache (no copy) and fresh ones for the rest. The runner applies the
returned (source, destination) copies in the order the manager's module docstring gives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_table import BlockList
from pagedkv.kv.request_blocks import KVRequest, RequestBlocks

if TYPE_CHECKING:
    from pagedkv.kv.block_pool import BlockPool
    from pagedkv.kv.eviction_log import EvictionLog


class SwapMixin:
    """KVCacheManager's swap methods (see the module docstring)."""

    _reqs: dict[str, RequestBlocks]
    pool: BlockPool
    host_pool: BlockPool | None
    block_size: int
    enable_caching: bool
    watermark_blocks: int
    eviction_log: EvictionLog
    _key_suffix: bytes

    def is_swapped(self, request_id: str) -> bool:
        state = self._reqs.get(request_id)
        return state is not None and state.host_blocks is not None

    def _resident(self, request: KVRequest) -> RequestBlocks:
        state = self._reqs.get(request.request_id)
        if state is None or state.host_blocks is not None:
            raise ValueError(f"request {request.request_id!r} is not resident on the device")
        return state

    def _swapped(self, request: KVRequest) -> RequestBlocks:
        state = self._reqs.get(request.request_id)
        if state is None or state.host_blocks is None:
            raise ValueError(f"request {request.request_id!r} is not swapped out")
        return state

    def can_swap_out(self, request: KVRequest) -> bool:
        """Whether the host pool has a free block for each of the request's non-null blocks."""
        state = self._reqs.get(request.request_id)
        if self.host_pool is None or state is None or state.host_blocks is not None:
            return False
        n = sum(1 for b in state.blocks if not b.is_null)
        return n <= self.host_pool.get_num_free_blocks()

    def swap_out(self, request: KVRequest) -> list[tuple[int, int]]:
        """Move the request to host blocks; returns (device_id, host_id) copies to do BEFORE the
        device blocks are reused. Device blocks are freed tail first (cached ones stay cached).
        Raises ValueError when it is not resident or the host pool is too small."""
        state = self._resident(request)
        if not self.can_swap_out(request):
            raise ValueError(f"not enough host blocks to swap out {request.request_id!r}")
        if state.partial_src is not None:  # copied by the runner by now
            self.pool.free_blocks([state.partial_src])
            state.partial_src = None
        device = state.blocks
        live = [b for b in device if not b.is_null]
        host_new = self.host_pool.get_new_blocks(len(live))
        host_null = self.host_pool.null_block
        it = iter(host_new)
        host_table = [host_null if b.is_null else next(it) for b in device]
        mapping = [(d.block_id, h.block_id) for d, h in zip(live, host_new, strict=True)]
        self.pool.free_blocks(reversed(live))
        state.host_blocks = host_table
        state.blocks = BlockList()
        state.num_cached_blocks = 0
        return mapping

    def _swap_in_hits(self, request: KVRequest, state: RequestBlocks) -> dict[int, KVCacheBlock]:
        """Table index -> device block still cached under that block's hash (no copy needed)."""
        if not self.enable_caching:
            return {}
        host = state.host_blocks
        hashes = state.block_hashes
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        get = self.pool.cached_block_hash_to_block.get
        hits = {}
        suffix = self._key_suffix
        for i in range(min(num_full, len(hashes), len(host))):
            if not host[i].is_null:
                block = get(hashes[i] + suffix if suffix else hashes[i])
                if block is not None:
                    hits[i] = block
        return hits

    def _swap_in_need(self, state: RequestBlocks, hits: dict[int, KVCacheBlock]) -> int:
        n = sum(1 for b in state.host_blocks if not b.is_null) - len(hits)
        return n + sum(1 for b in hits.values() if b.ref_cnt == 0)

    def can_swap_in(self, request: KVRequest) -> bool:
        """Whether the device can take the request back, keeping the watermark free.

        Blocks still cached on the device are reused (a cached block nobody holds costs one free
        block, one held by another request costs none); the others need a free block each.
        """
        state = self._reqs.get(request.request_id)
        if state is None or state.host_blocks is None:
            return False
        need = self._swap_in_need(state, self._swap_in_hits(request, state))
        return self.pool.get_num_free_blocks() - need >= self.watermark_blocks

    def swap_in(self, request: KVRequest) -> list[tuple[int, int]]:
        """Move the request back to the device; returns (host_id, device_id) copies to do.

        Full computed blocks whose hash is still in the device prefix cache are taken from it
        (touched, no copy); the rest get fresh blocks and are registered in the prefix cache
        again from the kept hash list. Host blocks are freed. Raises ValueError when the request
        is not swapped or device memory is short (see can_swap_in).
        """
        state = self._swapped(request)
        hits = self._swap_in_hits(request, state)
        need = self._swap_in_need(state, hits)
        if self.pool.get_num_free_blocks() - need < self.watermark_blocks:
            raise ValueError(f"not enough device blocks to swap in {request.request_id!r}")
        host = state.host_blocks
        if hits:
            self.pool.touch(hits.values())
        num_fresh = sum(1 for b in host if not b.is_null) - len(hits)
        self.eviction_log.allocating_for = request.request_id
        self.eviction_log.allocating_salt = getattr(request, "cache_salt", None)
        fresh = iter(self.pool.get_new_blocks(num_fresh))
        null = self.pool.null_block
        table = []
        mapping = []
        for i, h in enumerate(host):
            if h.is_null:
                table.append(null)
            elif i in hits:
                table.append(hits[i])
            else:
                d = next(fresh)
                table.append(d)
                mapping.append((h.block_id, d.block_id))
        self.host_pool.free_blocks([b for b in reversed(host) if not b.is_null])
        state.blocks = BlockList(table)
        state.host_blocks = None
        state.num_cached_blocks = 0
        if self.enable_caching:
            self._cache_blocks(request, state, min(request.num_computed_tokens,
                                                   request.num_tokens))
        return mapping
