"""HybridKVCacheManager: one KVCacheManager per KV cache group over ONE shared block pool.

For models whose layers mix attention types (hybrid_spec.py). Each group is a plain
`KVCacheManager` (its block tables, copy-on-write, swap, sliding-window freeing) built on the
shared device and host pools; this coordinator keeps the groups in step, with the scheduler's
interface (`KVCacheManagerAPI`, interface.py: the scheduler cannot tell them apart):

- prefix hit: the longest prefix every group can serve (hit_rule.py: a full-attention group
  needs every block, a sliding group the `cdiv(window - 1, block_size)` blocks before the hit
  point; the ones before stand as the null block in its table).
- allocation is all or nothing: the blocks every group needs are counted first, against the
  one pool, and only then taken;
- a group's blocks are cached under the request's block hash plus its group key (hashing.py),
  so the groups of one pool never collide; group 0's keys are the plain hashes, which the
  scheduler's pending-prefix check and the hash lists (`get_block_hashes`) refer to.

`get_block_ids` is group 0's table; `get_group_block_ids` every group's (the runner's input).
Pinned prefixes hold every group's blocks of the prefix by the same hit rule (pins.py).
Sub-block prefix hits (`prefix_match_unit` below the block size): after the longest prefix of
whole blocks every group serves, the hit goes on into the next block by the tokens every group
has a cached block for (each group's own index, partial_hits.py), and every group gets a copy of
its block (copy-on-write). Each group's rule holds at the hit point: a full group holds every
block before it; a sliding group the blocks its window reaches back to, which the whole-block
rule already gave it (the window ends no earlier), and the partial block (the window always
reaches the token just before the hit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool, host_pool_num_blocks
from pagedkv.kv.block_table import BlockIdTable
from pagedkv.kv.events import BlockStored, KVCacheEvent
from pagedkv.kv.hashing import BlockHash, group_key_suffix
from pagedkv.kv.hit_rule import longest_servable_prefix, window_blocks
from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.manager import (
    AllocStatus,
    KVCacheManager,
    KVRequest,
    PrefixCacheStats,
    _raise_runtime_error,
)
from pagedkv.kv.pins import PinInfo, PrefixPins, max_pinned_blocks
from pagedkv.utils import cdiv

GroupedBlocks = list[list[KVCacheBlock]]


class HybridKVCacheManager:
    """KV cache groups of a HybridKVCacheSpec over one pool (see module docstring)."""

    def __init__(self, spec: HybridKVCacheSpec, *, num_blocks: int, num_host_blocks: int = 0,
                 enable_caching: bool = True, enable_kv_cache_events: bool = False,
                 eviction_policy: str = "lru", max_num_batched_tokens: int | None = None,
                 **kwargs: Any) -> None:
        """`max_num_batched_tokens`: the scheduler's token budget, the longest prefill chunk
        (None: a whole prompt in one step); admission counts the blocks a chunk holds in every
        sliding group before the window moves on. `kwargs` (watermark, hash_algo,
        max_pinned_fraction, prefix_match_unit) as for KVCacheManager."""
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0, got {num_host_blocks!r}")
        self.spec = spec
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events,
                              eviction_policy=eviction_policy)
        self.host_pool = (BlockPool(host_pool_num_blocks(num_host_blocks), False)
                          if num_host_blocks > 0 else None)
        self.groups = [
            KVCacheManager(num_blocks=num_blocks, block_size=spec.block_size,
                           enable_caching=enable_caching, sliding_window=g.sliding_window,
                           pool=self.pool, host_pool=self.host_pool, group_idx=g.group_idx,
                           **kwargs)
            for g in spec.groups]
        first = self.groups[0]
        self.block_size = spec.block_size
        self.enable_caching = enable_caching
        self.sliding_window = None  # per group: self.groups[i].sliding_window
        self.num_usable_blocks = self.pool.num_usable_blocks
        self.watermark = first.watermark
        self.watermark_blocks = first.watermark_blocks
        self.hasher = first.hasher
        self.prefix_cache_stats = PrefixCacheStats()
        self._kinds = [g.spec.kind for g in spec.groups]
        self._windows = [g.sliding_window for g in spec.groups]
        self._suffixes = [group_key_suffix(g.group_idx) for g in spec.groups]
        # Per group: the blocks before a hit point it must hold (None: all; hit_rule.py).
        self.window_blocks = [window_blocks(g.sliding_window, spec.block_size)
                              for g in spec.groups]
        # Pins over every group's blocks (each group manager's own pins stay empty).
        self.pins = PrefixPins(self.pool, self.hasher, max_pinned_blocks(
            kwargs.get("max_pinned_fraction", 0.5), self.num_usable_blocks), self.window_blocks)

    # ------------------------------------------------------------------ prefix cache
    def update_block_hashes(self, request: KVRequest) -> list[BlockHash]:
        """Group 0's (plain) block hashes of the request, brought up to date."""
        return self.groups[0].update_block_hashes(request)

    def _hit_blocks(self, i: int, hashes: list[BlockHash], n: int) -> list[KVCacheBlock]:
        get = self.pool.cached_block_hash_to_block.get
        suffix = self._suffixes[i]
        need = self.window_blocks[i]
        first = 0 if need is None else max(n - need, 0)
        return [self.pool.null_block] * first + [get(h + suffix) for h in hashes[first:n]]

    def drop_partial_hit(self, computed_blocks: GroupedBlocks, num_hit_tokens: int
                         ) -> tuple[GroupedBlocks, int]:
        """A hit (`get_computed_blocks`'s) without its sub-block part: the whole-block hit
        every group serves (`_partial_hit` appended one block to each group's hits). Pure."""
        if not num_hit_tokens % self.block_size:
            return computed_blocks, num_hit_tokens
        return ([blocks[:-1] for blocks in computed_blocks],
                num_hit_tokens - num_hit_tokens % self.block_size)

    def get_computed_blocks(self, request: KVRequest) -> tuple[GroupedBlocks, int]:
        """The longest prefix every group can serve: (each group's hit blocks, tokens). As
        KVCacheManager.get_computed_blocks (pass the blocks to allocate_slots in this step)."""
        empty: GroupedBlocks = [[] for _ in self.groups]
        if not self.enable_caching:
            return empty, 0
        hashes = self.update_block_hashes(request)
        get = self.pool.cached_block_hash_to_block.get
        suffixes = self._suffixes
        n = longest_servable_prefix(
            0, min((request.num_tokens - 1) // self.block_size, len(hashes)), self.window_blocks,
            lambda g, i: get(hashes[i] + suffixes[g]) is not None)
        hits = [self._hit_blocks(i, hashes, n) for i in range(len(self.groups))] if n else empty
        num_hit_tokens = n * self.block_size + self._partial_hit(request, hashes, n, hits)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def _partial_hit(self, request: KVRequest, hashes: list[BlockHash], n: int,
                     hits: GroupedBlocks) -> int:
        """Tokens of block `n` every group has a cached block for (a multiple of the match
        unit; 0 without sub-block hits): appends each group's block to its `hits`."""
        if self.groups[0].partial_index is None:
            return 0
        parent = self.groups[0]._parent_key(request, hashes, n)
        start = n * self.block_size
        tokens = request.all_token_ids[start:]
        found = [g.partial_index.find(parent, tokens, request.num_tokens - 1 - start)
                 for g in self.groups]
        m = min(length for _, length in found)
        if m:
            for group_hits, (block, _) in zip(hits, found, strict=True):
                group_hits.append(block)
        return m

    # ------------------------------------------------------------------ admission
    def can_allocate(self, request: KVRequest, num_computed_blocks: int = 0, *,
                     computed_blocks: GroupedBlocks | None = None) -> AllocStatus:
        """OK / LATER / NEVER for the most blocks the request's current sequence holds at
        once: every block in a full-attention group; in a sliding group the window's before a
        prefill chunk plus the chunk's (at most `max_num_batched_tokens`), which stay until
        the next step frees what left the window. So a request admitted alone always fits.
        `num_computed_blocks`: hits held by other requests, summed over groups."""
        required_total = self.peak_blocks(request.num_tokens)
        pinned = self.pins.num_pinned_blocks  # out of reach but for the request's own hits
        if computed_blocks is not None:
            num_computed_blocks = sum(1 for blocks in computed_blocks for b in blocks
                                      if b.ref_cnt > 0 or b.is_null)
            if pinned:
                pinned -= len({b.block_id for blocks in computed_blocks for b in blocks
                               if self.pins.is_pinned(b)})
        if self.num_usable_blocks - pinned - required_total < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.pool.eviction.num_free_blocks - (required_total - num_computed_blocks) \
                >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def peak_blocks(self, num_tokens: int) -> int:
        """Most blocks a sequence of `num_tokens` tokens holds at once, over all groups."""
        bs = self.block_size
        blocks = cdiv(num_tokens, bs)
        chunk = cdiv(min(num_tokens, self.max_num_batched_tokens or num_tokens), bs)
        return sum(blocks if g.sliding_window is None
                   else min(blocks, cdiv(g.sliding_window - 1, bs) + 1 + chunk)
                   for g in self.groups)

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: KVRequest, num_new_tokens: int,
                       new_computed_blocks: GroupedBlocks | None = None,
                       num_new_computed_tokens: int = 0, *, delay_cache_blocks: bool = False,
                       apply_watermark: bool = False,
                       num_external_computed_tokens: int = 0,
                       num_tokens_ahead: int = 0,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """KVCacheManager.allocate_slots for every group, all or nothing: None (and no group
        changed but for its window's skipped blocks freed) when the pool cannot cover what
        all groups need. Returns group 0's new blocks. `num_external_computed_tokens` (vLLM's
        name): the new tokens are that many whole blocks the KV store loads; a sliding group
        gets blocks only for the ones its window needs at their end (the null block before)."""
        args = [self._group_args(i, request, hits, num_new_tokens, num_new_computed_tokens,
                                 num_external_computed_tokens)
                for i, hits in enumerate(new_computed_blocks or [None] * len(self.groups))]
        need = 0
        for group, (hits, n_new, n_computed) in zip(self.groups, args, strict=True):
            group.remove_skipped_blocks(request)
            need += group.num_blocks_to_allocate(request, n_new + num_lookahead_tokens, hits,
                                                 n_computed)
        available = self.pool.eviction.num_free_blocks
        if apply_watermark:
            available -= self.watermark_blocks
        if need > available:
            return None
        # Hold every group's hits first: a hit sitting in the free queue must not be handed
        # out as a new block to a group allocated before its own.
        held = [b for hits, _, _ in args if hits for b in hits if not b.is_null]
        self.pool.touch(held)
        out = None
        try:
            for group, (hits, n_new, n_computed) in zip(self.groups, args, strict=True):
                new = group.allocate_slots(request, n_new, hits, n_computed,
                                           delay_cache_blocks=delay_cache_blocks,
                                           num_tokens_ahead=num_tokens_ahead,
                                           num_lookahead_tokens=num_lookahead_tokens)
                if new is None:  # counted above: cannot happen unless the counts disagree
                    raise RuntimeError(f"group {group.group_idx} could not allocate for "
                                       f"{request.request_id!r} after the pool was checked")
                out = new if out is None else out
        finally:
            self.pool.free_blocks(held)
        return out

    def _group_args(self, i: int, request: KVRequest, hits: list[KVCacheBlock] | None,
                    num_new_tokens: int, num_new_computed_tokens: int, num_external: int
                    ) -> tuple[list[KVCacheBlock] | None, int, int]:
        """Group i's (hits, new tokens, new computed tokens): for a sliding group loading
        store blocks, those before its window at their end become null hits."""
        need = self.window_blocks[i]
        if not num_external or need is None:
            return hits, num_new_tokens, num_new_computed_tokens
        bs = self.block_size
        first = (request.num_computed_tokens + num_new_computed_tokens) // bs
        skip = max((first * bs + num_external) // bs - need - first, 0)
        return ((hits or []) + [self.pool.null_block] * skip, num_new_tokens - skip * bs,
                num_new_computed_tokens + skip * bs)

    def trim_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Free every group's blocks past the first cdiv(num_tokens, block_size) (allocated for
        a store load that did not deliver them: computed into fresh blocks instead)."""
        for g in self.groups:
            g.trim_blocks(request, num_tokens)

    def take_block_copies(self) -> list[tuple[int, int]]:
        return [c for g in self.groups for c in g.take_block_copies()]

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        for g in self.groups:
            g.cache_blocks(request, num_computed_tokens)

    # ------------------------------------------------------------------ free / fork / swap
    def free(self, request: KVRequest) -> None:
        """Free every group's blocks, the full-attention groups (the longest-lived prefix
        blocks) last so they are evicted last."""
        for g in reversed(self.groups):
            g.free(request)

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        for g in self.groups:
            g.fork(parent, child)

    def is_swapped(self, request_id: str) -> bool:
        return self.groups[0].is_swapped(request_id)

    def _num_live_blocks(self, request: KVRequest) -> int:
        return sum(1 for g in self.groups for b in g.get_blocks(request.request_id)
                   if not b.is_null)

    def can_swap_out(self, request: KVRequest) -> bool:
        if self.host_pool is None or not all(g.can_swap_out(request) for g in self.groups):
            return False
        return self._num_live_blocks(request) <= self.host_pool.get_num_free_blocks()

    def swap_out(self, request: KVRequest) -> list[tuple[int, int]]:
        if not self.can_swap_out(request):
            raise ValueError(f"cannot swap out {request.request_id!r}: not resident or not "
                             "enough host blocks")
        return [m for g in reversed(self.groups) for m in g.swap_out(request)]

    def can_swap_in(self, request: KVRequest) -> bool:
        if not self.is_swapped(request.request_id):
            return False
        need = 0
        for g in self.groups:
            state = g._reqs[request.request_id]
            need += g._swap_in_need(state, g._swap_in_hits(request, state))
        return self.pool.get_num_free_blocks() - need >= self.watermark_blocks

    def swap_in(self, request: KVRequest) -> list[tuple[int, int]]:
        if not self.can_swap_in(request):
            raise ValueError(f"cannot swap in {request.request_id!r}: not swapped or not "
                             "enough device blocks")
        saved, self.watermark_blocks = self.watermark_blocks, 0
        try:  # checked for all groups together above; each group's own check is then moot
            for g in self.groups:
                g.watermark_blocks = 0
            return [m for g in self.groups for m in g.swap_in(request)]
        finally:
            self.watermark_blocks = saved
            for g in self.groups:
                g.watermark_blocks = saved

    # ------------------------------------------------------------------ queries
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.groups[0].get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.groups[0].get_block_ids(request_id)

    def sync_block_ids(self, request_id: str, table: BlockIdTable) -> list[int]:
        return self.groups[0].sync_block_ids(request_id, table)

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Every group's device block ids, in group order (null blocks as 0)."""
        return [g.get_block_ids(request_id) for g in self.groups]

    def get_host_block_ids(self, request_id: str) -> list[int]:
        return [i for g in self.groups for i in g.get_host_block_ids(request_id)]

    def get_block_hashes(self, request_id: str) -> list[BlockHash]:
        return self.groups[0].get_block_hashes(request_id)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.eviction.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes but the pinned blocks'; only possible when no device block is
        in use except by pins."""
        return self.pool.reset_prefix_cache(self.pins.pinned_blocks())

    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        """Pin the longest cached prefix of the prompt every group serves: every group's
        blocks a hit there reads (pins.py). ValueError as for KVCacheManager.pin_prefix."""
        return self.pins.pin(token_ids, cache_salt)

    def unpin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        """Release the prompt's pin; NotPinnedError (a ValueError) when it has none."""
        return self.pins.unpin(token_ids, cache_salt)

    @property
    def num_pinned_blocks(self) -> int:
        return self.pins.num_pinned_blocks

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's events, each with its group's kind (vLLM's kv_cache_spec_kind)."""
        events = self.pool.take_events()
        for ev in events:
            if hasattr(ev, "group_idx"):
                ev.kv_cache_spec_kind = self._kinds[ev.group_idx]
            if isinstance(ev, BlockStored):
                ev.kv_cache_spec_sliding_window = self._windows[ev.group_idx]
        return events

    def check_invariants(self) -> None:
        """The shared pools' invariants with every group's tables, and each group's own."""
        device, host = [], []
        for g in self.groups:
            for rid, state in g._reqs.items():
                if state.host_blocks is not None:
                    host.append([b for b in state.host_blocks if not b.is_null])
                    if state.blocks:
                        raise RuntimeError(f"swapped request {rid!r} holds device blocks")
                else:
                    device.append([b for b in state.blocks if not b.is_null])
            device.extend([b] for b in g.held_copy_sources())
        self.pins.check_invariants(_raise_runtime_error)
        self.pool.check_invariants(device + self.pins.tables())
        if self.host_pool is not None:
            self.host_pool.check_invariants(host)
