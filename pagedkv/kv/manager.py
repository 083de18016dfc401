"""KVCacheManager: one KV cache group's per-request block tables over a device and a host
BlockPool: the scheduler's view of it is `KVCacheManagerAPI` (interface.py, the contract of
every public call, the step and the order of the runner's copies).

For each live request it keeps (request_blocks.RequestBlocks) the device block table (position
p lives in table[p // block_size]), the host block table while the request is swapped out, the
chained hashes of its full blocks (computed incrementally, once per block) and how many of its
blocks were already offered to the prefix cache. The parts: allocation.py (plan, then commit),
prefix_cache.py (lookups and registration), swap.py (swap preemption), single_type (the
attention type's table rules), pins.py (pinned prefixes). Lists returned by `get_blocks` are
the live tables: valid until the next call that changes that request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pagedkv.kv.allocation import NOTHING, commit_allocation, plan_allocation
from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool, host_pool_num_blocks
from pagedkv.kv.block_table import BlockIdTable, BlockList
from pagedkv.kv.events import BlockStored, KVCacheEvent
from pagedkv.kv.eviction_log import EvictionLog
from pagedkv.kv.hashing import BlockHash, RequestBlockHasher, group_key_suffix
from pagedkv.kv.partial_hits import PartialPrefixIndex, check_prefix_match_unit
from pagedkv.kv.pins import PinInfo, PrefixPins, check_max_pinned_fraction, max_pinned_blocks
from pagedkv.kv.prefix_cache import PrefixCacheMixin
from pagedkv.kv.request_blocks import (
    RECENT_PROMPTS,
    AllocStatus,
    KVRequest,
    PrefixCacheStats,
    RecentPrompt,
    RequestBlocks,
)
from pagedkv.kv.single_type import block_table_policy
from pagedkv.kv.swap import SwapMixin
from pagedkv.utils import cdiv

__all__ = ["AllocStatus", "KVCacheManager", "KVRequest", "PrefixCacheStats", "RecentPrompt"]


class KVCacheManager(PrefixCacheMixin, SwapMixin):
    """Block tables, prefix caching, copy-on-write, sliding window and swap for all requests
    (see the module docstring). Satisfies KVCacheManagerAPI: its public calls are documented
    there, the ones it adds (for the hybrid coordinator and the engine's readers) here."""

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

    # ------------------------------------------------------------------ helpers
    def _state(self, request_id: str) -> RequestBlocks:
        state = self._reqs.get(request_id)
        if state is None:
            state = self._reqs[request_id] = RequestBlocks()
        return state

    def update_block_hashes(self, request: KVRequest) -> list[BlockHash]:
        state = self._state(request.request_id)
        return self.hasher(request, state.block_hashes)

    # ------------------------------------------------------------------ admission
    def can_allocate(self, request: KVRequest, num_computed_blocks: int = 0, *,
                     computed_blocks: Sequence[KVCacheBlock] | None = None) -> AllocStatus:
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
                       num_tokens_ahead: int = 0,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"negative token count: num_new_tokens={num_new_tokens}, "
                             f"num_new_computed_tokens={num_new_computed_tokens}, "
                             f"num_lookahead_tokens={num_lookahead_tokens}")
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
        num_slots = num_new_tokens + num_lookahead_tokens  # positions this call makes room for
        if (num_new_tokens and not num_new_computed_tokens and state.partial_src is None
                and start // bs == (start + num_slots - 1) // bs == num_old - 1
                and blocks[-1].ref_cnt == 1):
            # The common decode step: its tokens land in the last block, which this request
            # alone holds: nothing to take, copy or release (the plan would be NOTHING), only
            # the window's skipped blocks to free (never the last block: it holds `start`).
            if self._remove_skipped_blocks is not None:
                self._remove_skipped_blocks(self.pool, blocks, request.num_computed_tokens)
            new_blocks: list[KVCacheBlock] = []
        else:
            allocated = self._allocate(request, state, num_slots, new_computed_blocks,
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
        """`allocate_slots`' general path, up to caching (allocation.py: plan, then commit);
        None (and only the window's skipped blocks freed) when the blocks are short."""
        if state.partial_src is not None:  # the runner has copied it by now
            self.pool.free_blocks([state.partial_src])
            state.partial_src = None
        remove_skipped = self._remove_skipped_blocks
        if remove_skipped is not None:
            remove_skipped(self.pool, state.blocks, request.num_computed_tokens)
        plan = plan_allocation(state.blocks, self.block_size, request.num_computed_tokens,
                               num_new_tokens, new_computed_blocks, num_new_computed_tokens,
                               sub_block_hits=self.partial_index is not None,
                               num_tokens_ahead=num_tokens_ahead)
        if plan is NOTHING:
            return []
        self.eviction_log.allocating_for = request.request_id
        self.eviction_log.allocating_salt = getattr(request, "cache_salt", None)
        available = self.pool.eviction.num_free_blocks
        if apply_watermark:
            available -= self.watermark_blocks
        if plan.num_needed > available:
            return None
        return commit_allocation(plan, state, self.pool, self._copies, self.block_size,
                                 remove_skipped)

    def trim_blocks(self, request: KVRequest, num_tokens: int) -> None:
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
        return plan_allocation(state.blocks if state is not None else [], self.block_size,
                               request.num_computed_tokens, num_new_tokens,
                               new_computed_blocks, num_new_computed_tokens,
                               sub_block_hits=self.partial_index is not None).num_needed

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    # ------------------------------------------------------------------ free / fork
    def free(self, request: KVRequest) -> None:
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
        state = self._reqs.get(request_id)
        return [b.block_id for b in state.blocks] if state is not None else []

    def sync_block_ids(self, request_id: str, table: BlockIdTable) -> list[int]:
        state = self._reqs.get(request_id)
        return table.sync(state.blocks if state is not None else [])

    def held_copy_sources(self) -> list[KVCacheBlock]:
        """Cached blocks held (one reference each) until the runner has copied them into a
        request's table (sub-block prefix hits)."""
        return [s.partial_src for s in self._reqs.values() if s.partial_src is not None]

    def get_group_block_ids(self, request_id: str) -> list[list[int]] | None:
        return None

    def get_host_block_ids(self, request_id: str) -> list[int]:
        state = self._reqs.get(request_id)
        if state is None or state.host_blocks is None:
            return []
        return [b.block_id for b in state.host_blocks]

    def get_block_hashes(self, request_id: str) -> list[BlockHash]:
        state = self._reqs.get(request_id)
        return state.block_hashes if state is not None else []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.eviction.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache(self.pins.pinned_blocks())

    # ------------------------------------------------------------------ pinned prefixes
    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        return self.pins.pin(token_ids, cache_salt)

    def unpin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        return self.pins.unpin(token_ids, cache_salt)

    @property
    def num_pinned_blocks(self) -> int:
        return self.pins.num_pinned_blocks

    def take_events(self) -> list[KVCacheEvent]:
        events = self.pool.take_events()
        kind = "full_attention" if self.sliding_window is None else "sliding_window"
        for ev in events:
            if isinstance(ev, BlockStored):
                ev.kv_cache_spec_kind = kind
                ev.kv_cache_spec_sliding_window = self.sliding_window
        return events

    def check_invariants(self) -> None:
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
