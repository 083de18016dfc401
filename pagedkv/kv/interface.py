"""KVCacheManagerAPI: the scheduler's view of the KV cache manager, documented once.

Two classes satisfy it: `KVCacheManager` (manager.py: one KV cache group, the block tables of
every request) and `HybridKVCacheManager` (coordinator.py: one `KVCacheManager` per group over
one shared pool, kept in step). The scheduler cannot tell them apart; build either with
`make_kv_cache_manager` (factory.py).

Typical step for a request (the scheduler's side):
    blocks, n = kv.get_computed_blocks(req)                 # waiting request: prefix-cache hit
    new = kv.allocate_slots(req, num_new_tokens, blocks, n)   # None: not enough memory now
    ... runner applies kv.take_block_copies(), runs the model ...
    req.num_computed_tokens += n + num_new_tokens
    kv.free(req) when it finishes / is preempted by recompute

Copies the runner must apply, in this order, before the forward pass: swap_out mappings
(device -> host, before those device blocks are reused), swap_in mappings (host -> device),
then take_block_copies() (copy-on-write, device -> device): a block freed by a swap-out can be
the destination of a swap-in or of a copy in the same step.

"Mutates" below names the state a call changes: the request's tables (its device and host
block tables, hashes and cached-block count), the pool (reference counts, the free queue, the
prefix cache, its events), the pending copies (drained by take_block_copies) and the counters
(prefix_cache_stats, recent_prompts). Calls that say nothing mutate nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_table import BlockIdTable
from pagedkv.kv.events import KVCacheEvent
from pagedkv.kv.hashing import BlockHash
from pagedkv.kv.pins import PinInfo, PrefixPins
from pagedkv.kv.request_blocks import AllocStatus, KVRequest, PrefixCacheStats

if TYPE_CHECKING:
    from pagedkv.kv.block_pool import BlockPool

# A prefix hit as get_computed_blocks returns it and allocate_slots takes it back: a list of
# blocks (one group) or one list per group (hybrid). The scheduler only passes it on.
ComputedBlocks = Any


@runtime_checkable
class KVCacheManagerAPI(Protocol):
    """What the scheduler (and the engine's readers) use of a KV cache manager (module
    docstring: the step, the copy order, what "mutates" means)."""

    block_size: int  # tokens per block
    enable_caching: bool  # prefix caching on
    num_usable_blocks: int  # device blocks requests can hold (the null block excluded)
    watermark_blocks: int  # free blocks admission keeps back
    pool: BlockPool  # the device pool (read by stats, events, the dashboard and the store)
    host_pool: BlockPool | None  # the swap pool; None without host blocks
    pins: PrefixPins  # pinned prefixes
    prefix_cache_stats: PrefixCacheStats  # cumulative hit counters

    # ------------------------------------------------------------------ prefix cache
    def update_block_hashes(self, request: KVRequest) -> list[BlockHash]:
        """Hash the request's newly full blocks (each block once); returns its live hash list
        (the plain hashes, group 0's with several groups). Mutates: the request's hashes."""
        ...

    def get_computed_blocks(self, request: KVRequest) -> tuple[ComputedBlocks, int]:
        """Longest cached prefix and its token count; touches no block.

        At most num_tokens - 1 tokens are reported, so the last token is always computed (it
        yields the logits). With several groups: the longest prefix every group can serve.
        With `prefix_match_unit` the hit may end inside a block (its source block last).
        The returned blocks stay valid as hits until the pool next allocates or resets: pass
        them to allocate_slots in the same scheduling step.
        Mutates: the request's hashes, prefix_cache_stats (one query of num_tokens tokens).
        """
        ...

    def drop_partial_hit(self, computed_blocks: ComputedBlocks, num_hit_tokens: int
                         ) -> tuple[ComputedBlocks, int]:
        """A hit (`get_computed_blocks`'s) without its sub-block part: the whole-block hit."""
        ...

    # ------------------------------------------------------------------ admission
    def can_allocate(self, request: KVRequest, num_computed_blocks: int = 0, *,
                     computed_blocks: ComputedBlocks | None = None) -> AllocStatus:
        """OK / LATER / NEVER for holding the request's whole current sequence.

        required_total = cdiv(num_tokens, block_size) (with sliding groups: the most blocks
        the sequence holds at once). `num_computed_blocks` is the number of prefix-hit blocks
        that need NO free memory, i.e. hits already held by other requests (ref_cnt > 0). A
        hit on a free cached block (ref_cnt 0) still consumes a free block when touched, so it
        must not be subtracted. Pass `computed_blocks` (the hits from get_computed_blocks)
        instead to have that count made here exactly. Pinned blocks are out of reach unless
        they are the request's own prefix hits:
        NEVER if usable - pinned - (required_total - pinned hits) < watermark_blocks; OK if
        free - (required_total - num_computed_blocks) >= watermark_blocks; else LATER.
        """
        ...

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: KVRequest, num_new_tokens: int,
                       new_computed_blocks: ComputedBlocks | None = None,
                       num_new_computed_tokens: int = 0, *, delay_cache_blocks: bool = False,
                       apply_watermark: bool = False,
                       num_external_computed_tokens: int = 0,
                       num_tokens_ahead: int = 0,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for positions [c, c + num_new_computed_tokens + num_new_tokens +
        num_lookahead_tokens), where c = request.num_computed_tokens; the lookahead slots
        (vLLM's) hold speculative tokens being verified: they are never cached by this call,
        and the scheduler gives back those of the rejected ones (`trim_blocks`). The first `num_tokens_ahead` of them are being written
        by a step still running (overlapped scheduling): a shared block holding them is copied
        whole when replaced (the copy runs after that step).

        First frees the blocks wholly outside the sliding window (they would be freed by any
        later call too; this happens even when the call returns None). Then, if the free blocks
        (minus prefix hits that sit in the free queue, and minus the watermark when
        apply_watermark) cannot cover the new blocks plus copy-on-write replacements, returns
        None and changes nothing else (all groups or none). Otherwise touches and appends
        `new_computed_blocks`, replaces shared blocks this step writes into (copies drained by
        take_block_copies), appends new blocks, and unless delay_cache_blocks caches the blocks
        full after this step. `num_external_computed_tokens`: how many of the new tokens a KV
        store loads (whole blocks; a sliding group gets blocks only for those its window needs).
        Returns the blocks appended at the table's end (group 0's; COW replacements are not
        included). Mutates: the request's tables, the pool, the pending copies.
        """
        ...

    def trim_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Free the request's device blocks past the first cdiv(num_tokens, block_size), tail
        first (blocks allocated for a store load that did not deliver them, or the lookahead
        slots of rejected speculative tokens: the next allocate_slots gives fresh ones). Nothing for an unknown or swapped request.
        Mutates: the request's tables, the pool."""
        ...

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Drain the (src_block_id, dst_block_id) copies the runner must do before the next
        step. Mutates: the pending copies (emptied)."""
        ...

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full within its first num_computed_tokens.
        Mutates: the request's hashes and cached-block count, the pool's prefix cache."""
        ...

    # ------------------------------------------------------------------ free / fork / swap
    def free(self, request: KVRequest) -> None:
        """Release the request's blocks tail first (device, or host if swapped) and forget it;
        unknown requests are ignored. Mutates: the request's tables (dropped), the pool,
        recent_prompts."""
        ...

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """Give `child` the parent's blocks (each ref up) and hashes. The child must be new and
        its tokens must equal the parent's; a write into a shared partial block copies it.
        ValueError when the parent is not resident or the child has state. Mutates: the
        child's tables, the pool's reference counts."""
        ...

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's blocks are on the host."""
        ...

    def can_swap_out(self, request: KVRequest) -> bool:
        """Whether the host pool has a free block for each of the request's non-null blocks."""
        ...

    def swap_out(self, request: KVRequest) -> list[tuple[int, int]]:
        """Move the request to host blocks; returns (device_id, host_id) copies to do BEFORE the
        device blocks are reused. Device blocks are freed tail first (cached ones stay cached).
        ValueError when it is not resident or the host pool is too small.
        Mutates: the request's tables, both pools."""
        ...

    def can_swap_in(self, request: KVRequest) -> bool:
        """Whether the device can take the request back, keeping the watermark free. Blocks
        still cached on the device are reused (a cached block nobody holds costs one free
        block, one held by another request costs none); the others need a free block each."""
        ...

    def swap_in(self, request: KVRequest) -> list[tuple[int, int]]:
        """Move the request back to the device; returns (host_id, device_id) copies to do.
        Full computed blocks whose hash is still in the device prefix cache are taken from it
        (touched, no copy); the rest get fresh blocks and are registered in the prefix cache
        again. ValueError when the request is not swapped or device memory is short.
        Mutates: the request's tables, both pools."""
        ...

    # ------------------------------------------------------------------ queries
    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The live device block table (group 0's; [] when unknown or swapped): valid until
        the next call that changes that request."""
        ...

    def get_block_ids(self, request_id: str) -> list[int]:
        """Device block ids of the request's table (group 0's); null blocks appear as 0."""
        ...

    def sync_block_ids(self, request_id: str, table: BlockIdTable) -> list[int]:
        """`get_block_ids`, kept in `table` (mutated; its list is returned): O(blocks
        appended since `table` last synced with this request's table), see block_table.py."""
        ...

    def get_group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """Every KV cache group's device block ids in group order; None with one group."""
        ...

    def get_host_block_ids(self, request_id: str) -> list[int]:
        """Host block ids while swapped ([] otherwise); null blocks appear as 0."""
        ...

    def get_block_hashes(self, request_id: str) -> list[BlockHash]:
        """The request's computed full-block hashes (live list; the plain hashes)."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Free device blocks (cached blocks nobody holds included)."""
        ...

    @property
    def usage(self) -> float:
        """Fraction of usable device blocks held by requests (unheld cached blocks are free)."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes but the pinned blocks'; only possible (True) when no device
        block is in use except by pins. Mutates: the pool's prefix cache."""
        ...

    # ------------------------------------------------------------------ pinned prefixes
    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        """Pin the prompt's leading cached blocks (every group's a hit there reads; pins.py).
        ValueError for a prompt without a full block or when `max_pinned_fraction` would be
        exceeded. Mutates: the pins, the pool's reference counts."""
        ...

    def unpin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PinInfo:
        """Release the prompt's pin; NotPinnedError (a ValueError) when it has none.
        Mutates: the pins, the pool's reference counts."""
        ...

    @property
    def num_pinned_blocks(self) -> int:
        """Device blocks held by pins."""
        ...

    # ------------------------------------------------------------------ events / checks
    def take_events(self) -> list[KVCacheEvent]:
        """The pool's events (drained), stored ones tagged with their group's kind and window
        (vLLM's kv_cache_spec_kind). Mutates: the pool's event queue (emptied)."""
        ...

    def check_invariants(self) -> None:
        """The pools' invariants with every live table and the pins, plus per-request
        consistency; RuntimeError naming the broken one."""
        ...
