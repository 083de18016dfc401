"""One request's allocation, in two halves: `plan_allocation` works out what a call of
`KVCacheManager.allocate_slots` takes, copies and touches without changing anything;
`commit_allocation` applies a plan the pool can cover.

Block layout of the request's table for one call (c = request.num_computed_tokens), after
vLLM v1's `KVCacheManager.allocate_slots`:

    ---------------------------------------------------------------------------
    | < computed >  | < new computed >  |           < new >           |
    ---------------------------------------------------------------------------
    |  held blocks  | prefix hits       | [ahead][rest of new tokens] |
    ---------------------------------------------------------------------------
    0               c                 start                          end
    |<- skipped ->|                    |<------ shared blocks here are replaced (COW)
    |<--------------------- required: cdiv(end, block_size) blocks ------------------>|

- computed: the blocks the request holds; in a sliding window those wholly before the window
  (skipped) are freed first and stand as the null block.
- new computed: `new_computed_blocks`, cached blocks touched and appended (whole blocks right
  after the held ones); with sub-block hits the last may end inside a block: its source is held
  and copied into a fresh block (copy-on-write of a cached block).
- new: positions [start, end) this step writes. A block in that range that another request
  shares (ref_cnt > 1) is replaced by a fresh one; the runner copies it when it holds tokens
  already written, i.e. before start + num_tokens_ahead ("ahead": tokens a step still in
  flight writes under overlapped scheduling). Then fresh blocks up to `required`; the
  manager counts the lookahead slots of speculative tokens (`num_lookahead_tokens`) among the
  new tokens here.

The plan is a tuple (no per-call object beyond it); the decode step whose tokens land in its
own last block never gets here (manager.allocate_slots' fast path), and any other call with
nothing to do gets the shared NOTHING plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.request_blocks import RequestBlocks

# A block-table policy's remove_skipped_blocks (None: it never frees skipped blocks).
RemoveSkipped = Callable[[BlockPool, list[KVCacheBlock], int], None] | None


class AllocationPlan(NamedTuple):
    """What one allocate_slots call takes from the pool (see the module docstring)."""

    start: int  # first position written (c + new computed tokens)
    hits: Sequence[KVCacheBlock]  # whole-block prefix hits to touch and append
    partial: KVCacheBlock | None  # a sub-block hit's source: held, copied into a fresh block
    cow: list[int] | None  # indices of shared blocks this step writes into
    copy_before: int  # a replaced block holding positions before this is copied
    num_new_blocks: int  # fresh blocks appended at the end
    num_needed: int  # free blocks the plan takes (hits in the free queue included)


NOTHING = AllocationPlan(0, (), None, None, 0, 0, 0)  # what a call with nothing to do gets


def plan_allocation(blocks: list[KVCacheBlock], block_size: int, num_computed_tokens: int,
                    num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None,
                    num_new_computed_tokens: int, *, sub_block_hits: bool,
                    num_tokens_ahead: int = 0) -> AllocationPlan:
    """The plan for a request holding `blocks` (its table, skipped blocks already freed) with
    `num_computed_tokens` computed; arguments as for allocate_slots. Pure. `sub_block_hits`:
    the manager has a sub-block index (a hit whose token count is not whole blocks ends in
    a partial block). ValueError when the hits do not cover exactly the whole blocks right
    after the held ones."""
    bs = block_size
    start = num_computed_tokens + num_new_computed_tokens
    end = start + num_new_tokens
    num_old = len(blocks)
    partial = None
    if sub_block_hits and num_new_computed_tokens % bs and new_computed_blocks:
        partial = new_computed_blocks[-1]
        new_computed_blocks = new_computed_blocks[:-1]
        num_new_computed_tokens -= num_new_computed_tokens % bs
    num_ncb = len(new_computed_blocks) if new_computed_blocks else 0
    if num_ncb and (num_new_computed_tokens != num_ncb * bs or num_computed_tokens != num_old * bs):
        raise ValueError(f"new_computed_blocks ({num_ncb} blocks) must cover exactly "
                         f"num_new_computed_tokens={num_new_computed_tokens} tokens right "
                         f"after the {num_old} full blocks the request holds")
    num_required = -(-end // bs)  # cdiv, inlined: this runs once per request per step
    num_new_blocks = num_required - num_old - num_ncb - (partial is not None)
    if num_new_blocks < 0:
        num_new_blocks = 0
    cow = None  # indices of the held blocks this step writes into that others share
    first = start // bs
    if num_new_tokens and first < num_old:
        for i in range(first, num_old if num_old < num_required else num_required):
            if blocks[i].ref_cnt > 1:
                if cow is None:
                    cow = []
                cow.append(i)
    if not (num_new_blocks or cow or num_ncb or partial is not None):
        return NOTHING
    num_needed = num_new_blocks + len(cow) if cow else num_new_blocks
    if partial is not None:  # the copy's block; the source too while it is free
        num_needed += 1 + (partial.ref_cnt == 0)
    if num_ncb:
        for b in new_computed_blocks:  # hits in the free queue are not free for us
            if b.ref_cnt == 0 and not b.is_null:
                num_needed += 1
    return AllocationPlan(start, new_computed_blocks or (), partial, cow,
                          start + num_tokens_ahead, num_new_blocks, num_needed)


def commit_allocation(plan: AllocationPlan, state: RequestBlocks, pool: BlockPool,
                      copies: list[tuple[int, int]], block_size: int,
                      remove_skipped: RemoveSkipped) -> list[KVCacheBlock]:
    """Apply `plan` (the pool has its `num_needed` free blocks): touch and append the hits,
    hold and copy the sub-block hit, replace the shared blocks written (copies appended to
    `copies`), append fresh blocks. Returns the fresh blocks appended at the end."""
    blocks = state.blocks
    hits = plan.hits
    if hits:
        num_old = len(blocks)
        pool.touch([b for b in hits if not b.is_null] if remove_skipped is not None else hits)
        if state.num_cached_blocks == num_old:
            state.num_cached_blocks += len(hits)
        blocks.extend(hits)
    partial = plan.partial
    if partial is not None:
        pool.touch([partial])
        state.partial_src = partial
        copy = pool.get_new_blocks(1)[0]
        blocks.append(copy)
        copies.append((partial.block_id, copy.block_id))
    if plan.cow:
        _copy_on_write(pool, blocks, plan.cow, plan.copy_before, block_size, copies)
    new_blocks = pool.get_new_blocks(plan.num_new_blocks) if plan.num_new_blocks else []
    if new_blocks:
        blocks.extend(new_blocks)
    if hits and remove_skipped is not None:
        remove_skipped(pool, blocks, plan.start)
    return new_blocks


def _copy_on_write(pool: BlockPool, blocks: list[KVCacheBlock], indices: list[int],
                   copy_before: int, block_size: int, copies: list[tuple[int, int]]) -> None:
    """Replace the shared blocks at `indices` with fresh ones; those holding positions before
    `copy_before` (tokens already written) are copied by the runner."""
    fresh = pool.get_new_blocks(len(indices))
    olds = []
    for i, new in zip(indices, fresh, strict=True):
        olds.append(blocks[i])
        if i * block_size < copy_before:
            copies.append((blocks[i].block_id, new.block_id))
        blocks[i] = new
    # Every old block is shared (ref_cnt > 1), so this only drops our reference.
    pool.free_blocks(olds)
