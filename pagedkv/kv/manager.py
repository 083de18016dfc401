"""KVCacheManager: per-request block tables on top of a device and a host BlockPool.

The scheduler allocates and frees through this class (the engine only reads its stats and
events and checks its invariants). For each live request it keeps the device block table
(list of KVCacheBlock; position p lives in table[p // block_size]), the host block table while
the request is swapped out, the chained hashes of its full blocks (computed incrementally, once
per block) and how many of its blocks were already offered to the prefix cache.

Typical step for a request (the scheduler's side):
    blocks, n = mgr.get_computed_blocks(req)             # waiting request: prefix-cache hit
    new = mgr.allocate_slots(req, num_new_tokens, blocks, n)   # None: not enough memory now
    ... runner applies mgr.take_block_copies(), runs the model ...
    req.num_computed_tokens += n + num_new_tokens
    mgr.free(req) when it finishes / is preempted by recompute

Copies the runner must apply, in this order, before the forward pass: swap_out mappings
(device -> host, before those device blocks are reused), swap_in mappings (host -> device),
then take_block_copies() (copy-on-write, device -> device): a block freed by a swap-out can be
the destination of a swap-in or of a copy in the same step.

Lists returned by `get_blocks` are the live tables: valid until the next call that changes
that request (allocate_slots, free, swap_out, swap_in).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool, host_pool_num_blocks
from pagedkv.kv.block_table import BlockIdTable, BlockList
from pagedkv.kv.events import BlockStored, KVCacheEvent
from pagedkv.kv.eviction_log import EvictionLog
from pagedkv.kv.hashing import BlockHash, RequestBlockHasher, group_key_suffix
from pagedkv.kv.interface import KVCacheManagerAPI
from pagedkv.kv.partial_hits import (
    PartialPrefixIndex,
    check_prefix_match_unit,
    first_parent_key,
)
from pagedkv.kv.pins import PinInfo, PrefixPins, check_max_pinned_fraction, max_pinned_blocks
from pagedkv.kv.request_blocks import (
    RECENT_PROMPTS,
    AllocStatus,
    KVRequest,
    PrefixCacheStats,
    RecentPrompt,
    RequestBlocks,
)
from pagedkv.kv.single_type import block_table_policy
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.kv.swap import SwapMixin
from pagedkv.utils import cdiv

__all__ = ["AllocStatus", "KVCacheManager", "KVRequest", "PrefixCacheStats", "RecentPrompt"]


class KVCacheManager(SwapMixin):
    """Block tables, prefix caching, copy-on-write, sliding window and swap (swap.py) for all
    requests. The per-request types live in request_blocks.py."""

    def __init__(self, *, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_caching: bool = True, sliding_window: int | None = None,
                 watermark: float = 0.01, hash_algo: str = "sha256",
                 enable_kv_cache_events: bool = False, eviction_policy: str = "lru",
                 max_pinned_fraction: float = 0.5, pool: BlockPool | None = None,
                 host_pool: BlockPool | None = None, group_idx: int = 0,
                 prefix_match_unit: int | None = None) -> None:
        """`pool` / `host_pool` / `group_idx`: set by the hybrid coordinator (coordinator.py)
        when this manager is one KV cache group over a pool shared with other groups; the
        group's blocks are cached under `group_block_key(hash, group_idx)` (group 0: the plain
        hash). Without them the manager owns its pools (num_blocks, num_host_blocks).
        `prefix_match_unit` (a divisor of block_size; None or block_size: off): prefix hits
        may end inside a block, in units of that many tokens (partial_hits.py)."""
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0, got {num_host_blocks!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.block_policy = block_table_policy(block_size, sliding_window)
        # Bound once: None when the policy never frees skipped blocks (the decode hot path then
        # pays one attribute test, not a call).
        self._remove_skipped_blocks = (self.block_policy.remove_skipped_blocks
                                       if self.block_policy.frees_skipped_blocks else None)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        check_max_pinned_fraction(max_pinned_fraction)
        self.group_idx = group_idx
        self._key_suffix = group_key_suffix(group_idx)
        self.pool = pool if pool is not None else BlockPool(
            num_blocks, enable_caching, enable_kv_cache_events, eviction_policy=eviction_policy)
        self.host_pool = host_pool if pool is not None else (
            BlockPool(host_pool_num_blocks(num_host_blocks), False)
            if num_host_blocks > 0 else None)
        self.num_usable_blocks = self.pool.num_usable_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * self.num_usable_blocks)
        self.hasher = RequestBlockHasher(hash_algo, block_size)
        self.pins = PrefixPins(self.pool, self.hasher,
                               max_pinned_blocks(max_pinned_fraction, self.num_usable_blocks))
        self.prefix_cache_stats = PrefixCacheStats()
        self.eviction_log = EvictionLog(eviction_policy)
        self.pool.eviction_log = self.eviction_log
        # The prompts of the newest finished requests (explain: nearest cached prefix).
        self.recent_prompts: deque[RecentPrompt] = deque(maxlen=RECENT_PROMPTS)
        check_prefix_match_unit(prefix_match_unit, block_size)
        self.prefix_match_unit = prefix_match_unit
        self.partial_index = (
            PartialPrefixIndex(self.pool, self.hasher.hash_fn, block_size, prefix_match_unit,
                               self._key_suffix)
            if enable_caching and prefix_match_unit and prefix_match_unit < block_size
            and (sliding_window is None or pool is not None) else None)
        self._reqs: dict[str, RequestBlocks] = {}
        self._copies: list[tuple[int, int]] = []

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, *, num_blocks: int, **kwargs: Any) -> KVCacheManagerAPI:
        """Deprecated: `make_kv_cache_manager` (factory.py), which this calls."""
        from pagedkv.kv.factory import make_kv_cache_manager

        return make_kv_cache_manager(spec, num_blocks=num_blocks, **kwargs)

    # ------------------------------------------------------------------ helpers
    def _state(self, request_id: str) -> RequestBlocks:
        state = self._reqs.get(request_id)
        if state is None:
            state = self._reqs[request_id] = RequestBlocks()
        return state

    def update_block_hashes(self, request: KVRequest) -> list[BlockHash]:
        """Hash the request's newly full blocks (each block once); returns its live hash list."""
        state = self._state(request.request_id)
        return self.hasher(request, state.block_hashes)

    # ------------------------------------------------------------------ prefix cache
    def drop_partial_hit(self, computed_blocks: list[KVCacheBlock], num_hit_tokens: int
                         ) -> tuple[list[KVCacheBlock], int]:
        """A hit (`get_computed_blocks`'s) without its sub-block part: the whole-block hit.
        Pure. A sub-block hit ends inside a block, its source block last."""
        if not num_hit_tokens % self.block_size:
            return computed_blocks, num_hit_tokens
        return computed_blocks[:-1], num_hit_tokens - num_hit_tokens % self.block_size

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks and its token count; touches nothing.

        At most num_tokens - 1 tokens are reported, so the last token is always computed (it
        yields the logits). Counts one query of request.num_tokens tokens in prefix_cache_stats.
        The returned blocks stay valid as hits until the pool next allocates or resets: pass
        them to allocate_slots in the same scheduling step.
        """
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

    # ------------------------------------------------------------------ admission
    def can_allocate(self, request: KVRequest, num_computed_blocks: int = 0, *,
                     computed_blocks: Sequence[KVCacheBlock] | None = None) -> AllocStatus:
        """OK / LATER / NEVER for holding the request's whole current sequence.

        required_total = cdiv(num_tokens, block_size). `num_computed_blocks` is the number of
        prefix-hit blocks that need NO free memory, i.e. hits already held by other requests
        (ref_cnt > 0). A hit on a free cached block (ref_cnt 0) still consumes a free block when
        touched, so it must not be subtracted. Pass `computed_blocks` (the hits from
        get_computed_blocks) instead to have that count made here exactly.
        Pinned blocks are out of reach unless they are the request's own prefix hits:
        NEVER if usable - pinned - (required_total - pinned hits) < watermark_blocks; OK if
        free - (required_total - num_computed_blocks) >= watermark_blocks; else LATER.
        """
        pinned = self.pins.num_pinned_blocks
        if computed_blocks is not None:
            num_computed_blocks = sum(1 for b in computed_blocks if b.ref_cnt > 0)
            if pinned:
                pinned -= sum(1 for b in computed_blocks if self.pins.is_pinned(b))
        required_total = cdiv(request.num_tokens, self.block_size)
        if self.num_usable_blocks - pinned - required_total < self.watermark_blocks:
            return AllocStatus.NEVER
        required = required_total - num_computed_blocks
        if self.pool.eviction.num_free_blocks - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: KVRequest, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0, *, delay_cache_blocks: bool = False,
                       apply_watermark: bool = False,
                       num_external_computed_tokens: int = 0,
                       num_tokens_ahead: int = 0) -> list[KVCacheBlock] | None:
        """Make room for positions [c, c + num_new_computed_tokens + num_new_tokens), where
        c = request.num_computed_tokens. The first `num_tokens_ahead` of them are being written
        by a step still running (overlapped scheduling): a shared block holding them is copied
        whole when replaced (the copy runs after that step).

        First frees the blocks wholly outside the sliding window (they would be freed by any
        later call too; this happens even when the call returns None). Then, if the free blocks
        (minus prefix hits that sit in the free queue, and minus the watermark when
        apply_watermark) cannot cover the new blocks plus copy-on-write replacements, returns
        None and changes nothing else. Otherwise touches and appends `new_computed_blocks`,
        replaces shared blocks this step writes into (copies drained by take_block_copies),
        appends new blocks, and unless delay_cache_blocks caches the blocks full after this step.
        `num_external_computed_tokens`: how many of the new tokens a KV store loads (whole
        blocks; they need blocks as computed ones do with one group: see coordinator.py).
        Returns the blocks appended at the table's end (COW replacements are not included).
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(f"negative token count: num_new_tokens={num_new_tokens}, "
                             f"num_new_computed_tokens={num_new_computed_tokens}")
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = RequestBlocks()
        elif state.host_blocks is not None:
            raise ValueError(f"request {request.request_id!r} is swapped out; swap_in first")
        blocks = state.blocks
        bs = self.block_size
        start = request.num_computed_tokens + num_new_computed_tokens  # first position written
        end = start + num_new_tokens
        num_old = len(blocks)
        if (num_new_tokens and not num_new_computed_tokens and state.partial_src is None
                and self._remove_skipped_blocks is None
                and start // bs == (end - 1) // bs == num_old - 1 and blocks[-1].ref_cnt == 1):
            # The common decode step: its tokens land in the last block, which this request
            # alone holds: nothing to take, copy, release or free (what `_allocate` finds).
            new_blocks: list[KVCacheBlock] = []
        else:
            allocated = self._allocate(request, state, num_new_tokens, new_computed_blocks,
                                       num_new_computed_tokens, apply_watermark,
                                       num_tokens_ahead)
            if allocated is None:
                return None
            new_blocks = allocated
        if self.enable_caching and not delay_cache_blocks:
            num_tokens = request.num_tokens
            if end > num_tokens:
                end = num_tokens
            if end // bs > state.num_cached_blocks:
                self._cache_blocks(request, state, end)
        return new_blocks

    def _allocate(self, request: KVRequest, state: RequestBlocks, num_new_tokens: int,
                  new_computed_blocks: list[KVCacheBlock] | None, num_new_computed_tokens: int,
                  apply_watermark: bool, num_tokens_ahead: int) -> list[KVCacheBlock] | None:
        """`allocate_slots`' general path, up to caching: mutates `state` and the pool; None
        (and only the window's skipped blocks freed) when the blocks are short."""
        blocks = state.blocks
        bs = self.block_size
        start = request.num_computed_tokens + num_new_computed_tokens  # first position written
        end = start + num_new_tokens
        num_old = len(blocks)
        if state.partial_src is not None:  # the runner has copied it by now
            self.pool.free_blocks([state.partial_src])
            state.partial_src = None
        partial = None
        if self.partial_index is not None and num_new_computed_tokens % bs \
                and new_computed_blocks:  # a sub-block hit, last
            partial = new_computed_blocks[-1]
            new_computed_blocks = new_computed_blocks[:-1]
            num_new_computed_tokens -= num_new_computed_tokens % bs
        num_ncb = len(new_computed_blocks) if new_computed_blocks else 0
        if num_ncb and (num_new_computed_tokens != num_ncb * bs
                        or request.num_computed_tokens != num_old * bs):
            raise ValueError(f"new_computed_blocks ({num_ncb} blocks) must cover exactly "
                             f"num_new_computed_tokens={num_new_computed_tokens} tokens right "
                             f"after the {num_old} full blocks the request holds")
        remove_skipped = self._remove_skipped_blocks
        if remove_skipped is not None:
            remove_skipped(self.pool, blocks, request.num_computed_tokens)
        num_required = -(-end // bs)  # cdiv, inlined: this runs once per request per step
        num_new_blocks = num_required - num_old - num_ncb
        if partial is not None:  # its copy takes the place of one new block
            num_new_blocks -= 1
        if num_new_blocks < 0:
            num_new_blocks = 0
        # Copy-on-write: existing shared blocks that this step writes into.
        cow = None
        first = start // bs
        if num_new_tokens and first < num_old:
            for i in range(first, num_old if num_old < num_required else num_required):
                if blocks[i].ref_cnt > 1:
                    if cow is None:
                        cow = []
                    cow.append(i)
        pool = self.pool
        if num_new_blocks or cow or num_ncb or partial is not None:
            self.eviction_log.allocating_for = request.request_id
            self.eviction_log.allocating_salt = getattr(request, "cache_salt", None)
            num_needed = (num_new_blocks + len(cow)) if cow else num_new_blocks
            if partial is not None:  # the copy's block; the source too while it is free
                num_needed += 1 + (partial.ref_cnt == 0)
            available = pool.eviction.num_free_blocks
            if num_ncb:
                for b in new_computed_blocks:  # hits in the free queue are not free for us
                    if b.ref_cnt == 0 and not b.is_null:
                        available -= 1
            if apply_watermark:
                available -= self.watermark_blocks
            if num_needed > available:
                return None
            if num_ncb:
                pool.touch([b for b in new_computed_blocks if not b.is_null]
                           if remove_skipped is not None else new_computed_blocks)
                if state.num_cached_blocks == num_old:
                    state.num_cached_blocks += num_ncb
                blocks.extend(new_computed_blocks)
            if partial is not None:
                pool.touch([partial])
                state.partial_src = partial
                copy = pool.get_new_blocks(1)[0]
                blocks.append(copy)
                self._copies.append((partial.block_id, copy.block_id))
            if cow:
                self._copy_on_write(blocks, cow, start + num_tokens_ahead)
            if num_new_blocks:
                new_blocks = pool.get_new_blocks(num_new_blocks)
                blocks.extend(new_blocks)
            else:
                new_blocks = []
            if num_ncb and remove_skipped is not None:
                remove_skipped(pool, blocks, start)
        else:
            new_blocks = []
        return new_blocks

    def trim_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Free the request's device blocks past the first cdiv(num_tokens, block_size), tail
        first (blocks allocated for a store load that did not deliver them: the next
        allocate_slots gives fresh ones). Nothing for an unknown or swapped request."""
        state = self._reqs.get(request.request_id)
        if state is None or state.host_blocks is not None:
            return
        keep = cdiv(num_tokens, self.block_size)
        if len(state.blocks) > keep:
            self.pool.free_blocks([b for b in reversed(state.blocks[keep:]) if not b.is_null])
            del state.blocks[keep:]
            state.num_cached_blocks = min(state.num_cached_blocks, keep)

    def remove_skipped_blocks(self, request: KVRequest) -> None:
        """Free the blocks wholly outside the sliding window (what allocate_slots does first);
        nothing for full attention or an unknown / swapped request."""
        state = self._reqs.get(request.request_id)
        if self._remove_skipped_blocks is not None and state is not None \
                and state.host_blocks is None:
            self._remove_skipped_blocks(self.pool, state.blocks, request.num_computed_tokens)

    def num_blocks_to_allocate(self, request: KVRequest, num_new_tokens: int,
                               new_computed_blocks: list[KVCacheBlock] | None = None,
                               num_new_computed_tokens: int = 0) -> int:
        """Free blocks `allocate_slots` with these arguments would take from the pool (new
        blocks, copy-on-write replacements, prefix hits sitting in the free queue), once the
        window's skipped blocks are freed (`remove_skipped_blocks`). Changes nothing."""
        state = self._reqs.get(request.request_id)
        blocks = state.blocks if state is not None else []
        bs = self.block_size
        start = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(start + num_new_tokens, bs)
        ncb = new_computed_blocks or []
        need = max(num_required - len(blocks) - len(ncb), 0)
        if ncb and num_new_computed_tokens % bs and self.partial_index is not None:
            need += 1  # a sub-block hit, last: its copy's block
        if num_new_tokens:
            need += sum(1 for b in blocks[start // bs:num_required] if b.ref_cnt > 1)
        return need + sum(1 for b in ncb if b.ref_cnt == 0 and not b.is_null)

    def _copy_on_write(self, blocks: list[KVCacheBlock], indices: list[int], start: int) -> None:
        bs = self.block_size
        fresh = self.pool.get_new_blocks(len(indices))
        olds = []
        for i, new in zip(indices, fresh, strict=True):
            old = blocks[i]
            blocks[i] = new
            olds.append(old)
            if i * bs < start:  # holds tokens already written: the runner must copy them
                self._copies.append((old.block_id, new.block_id))
        # Every old block is shared (ref_cnt > 1), so this only drops our reference.
        self.pool.free_blocks(olds)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Drain the (src_block_id, dst_block_id) copies the runner must do before the next step."""
        copies, self._copies = self._copies, []
        return copies

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full within its first num_computed_tokens."""
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

    # ------------------------------------------------------------------ free / fork
    def free(self, request: KVRequest) -> None:
        """Release the request's blocks tail first (device, or host if swapped) and forget it.

        Unknown requests are ignored.
        """
        state = self._reqs.pop(request.request_id, None)
        if state is None:
            return
        self.recent_prompts.append(RecentPrompt(
            request.request_id, request.all_token_ids, getattr(request, "cache_salt", None),
            state.block_hashes))
        if state.partial_src is not None:
            self.pool.free_blocks([state.partial_src])
        if self.partial_index is not None and state.host_blocks is None:
            self._offer_partial_tail(request, state)
        if state.host_blocks is not None:
            self.host_pool.free_blocks([b for b in reversed(state.host_blocks) if not b.is_null])
        if state.blocks:
            self.pool.free_blocks(self.block_policy.blocks_to_free(state.blocks))

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """Give `child` the parent's blocks (each ref up) and hashes. The child must be new and
        its tokens must equal the parent's; a write into a shared partial block copies it."""
        pstate = self._reqs.get(parent.request_id)
        if pstate is None or pstate.host_blocks is not None:
            raise ValueError(f"cannot fork {parent.request_id!r}: not resident on the device")
        if child.request_id in self._reqs:
            raise ValueError(f"cannot fork into {child.request_id!r}: it already has state")
        cstate = self._reqs[child.request_id] = RequestBlocks()
        cstate.blocks = BlockList(pstate.blocks)
        cstate.block_hashes = list(pstate.block_hashes)
        cstate.num_cached_blocks = pstate.num_cached_blocks
        self.pool.touch([b for b in cstate.blocks if not b.is_null])

    # ------------------------------------------------------------------ queries
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The live device block table ([] when unknown or swapped)."""
        state = self._reqs.get(request_id)
        return state.blocks if state is not None else []

    def block_table(self, request_id: str) -> tuple[list[KVCacheBlock], bool] | None:
        """The request's block table (the live list: read it before the next step) and whether
        it is the host table (swapped out); None for an unknown request."""
        state = self._reqs.get(request_id)
        if state is None:
            return None
        if state.host_blocks is not None:
            return state.host_blocks, True
        return state.blocks, False

    def live_block_hashes(self) -> list[list[BlockHash]]:
        """Each known request's full-block hash chain (live lists), for parent lookups."""
        return [state.block_hashes for state in self._reqs.values()]

    def get_block_ids(self, request_id: str) -> list[int]:
        """Device block ids of the request's table; null blocks appear as 0."""
        state = self._reqs.get(request_id)
        return [b.block_id for b in state.blocks] if state is not None else []

    def sync_block_ids(self, request_id: str, table: BlockIdTable) -> list[int]:
        """`get_block_ids`, kept in `table` (mutated; its list is returned): O(blocks
        appended since `table` last synced with this request's table), see block_table.py."""
        state = self._reqs.get(request_id)
        return table.sync(state.blocks if state is not None else [])

    def held_copy_sources(self) -> list[KVCacheBlock]:
        """Cached blocks held (one reference each) until the runner has copied them into a
        request's table (sub-block prefix hits)."""
        return [s.partial_src for s in self._reqs.values() if s.partial_src is not None]

    def get_group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """Every KV cache group's table: None, this manager is the only group (see
        coordinator.py for caches with several)."""
        return None

    def get_host_block_ids(self, request_id: str) -> list[int]:
        """Host block ids while swapped ([] otherwise); null blocks appear as 0."""
        state = self._reqs.get(request_id)
        if state is None or state.host_blocks is None:
            return []
        return [b.block_id for b in state.host_blocks]

    def get_block_hashes(self, request_id: str) -> list[BlockHash]:
        """The request's computed block hashes (live list)."""
        state = self._reqs.get(request_id)
        return state.block_hashes if state is not None else []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.eviction.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable device blocks held by requests (unheld cached blocks are free)."""
        return self.pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes but the pinned blocks'; only possible when no device block is
        in use except by pins."""
        return self.pool.reset_prefix_cache(self.pins.pinned_blocks())

    # ------------------------------------------------------------------ pinned prefixes
    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        """Pin the prompt's leading cached full blocks (see pagedkv.kv.pins). ValueError for a
        prompt without a full block or when `max_pinned_fraction` would be exceeded."""
        return self.pins.pin(token_ids, cache_salt)

    def unpin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        """Release the prompt's pin; NotPinnedError (a ValueError) when it has none."""
        return self.pins.unpin(token_ids, cache_salt)

    @property
    def num_pinned_blocks(self) -> int:
        return self.pins.num_pinned_blocks

    def take_events(self) -> list[KVCacheEvent]:
        """The pool's events (drained), stored ones tagged with the cache's kind and window
        (vLLM's kv_cache_spec_kind: one group, sliding only when every layer slides)."""
        events = self.pool.take_events()
        kind = "full_attention" if self.sliding_window is None else "sliding_window"
        for ev in events:
            if isinstance(ev, BlockStored):
                ev.kv_cache_spec_kind = kind
                ev.kv_cache_spec_sliding_window = self.sliding_window
        return events

    def check_invariants(self) -> None:
        """Pool invariants with the live tables, plus per-request consistency. RuntimeError."""
        device_tables = []
        host_tables = []
        for rid, state in self._reqs.items():
            if state.host_blocks is not None:
                host_tables.append([b for b in state.host_blocks if not b.is_null])
                if state.blocks:
                    raise RuntimeError(f"swapped request {rid!r} still holds device blocks")
            else:
                device_tables.append([b for b in state.blocks if not b.is_null])
                if state.partial_src is not None:
                    device_tables.append([state.partial_src])
            if state.host_blocks is None and state.num_cached_blocks > len(state.blocks):
                raise RuntimeError(f"request {rid!r}: num_cached_blocks "
                                   f"{state.num_cached_blocks} > {len(state.blocks)} blocks")
        self.pins.check_invariants(_raise_runtime_error)
        self.pool.check_invariants(device_tables + self.pins.tables())
        if self.host_pool is not None:
            self.host_pool.check_invariants(host_tables)


def _raise_runtime_error(message: str) -> None:
    raise RuntimeError(f"KV cache manager invariant violated: {message}")
