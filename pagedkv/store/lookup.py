"""How many prompt tokens after the device prefix hit the KV store can provide: one rule for
the engine's connector (`connector.StoreConnectorScheduler`) and the simulator's
(`pagedkv.sim.store`). Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.kv.manager import KVCacheManager
    from pagedkv.store.interfaces import StoreRequest


def store_matched_tokens(request: StoreRequest, num_computed_tokens: int, kv: KVCacheManager,
                         lookup: Callable[[Sequence[bytes]], int]) -> tuple[int, bool]:
    """(tokens, whether the tiers were looked up now). The consecutive full prompt blocks
    after the first `num_computed_tokens` tokens that `lookup` says some tier holds (the last
    prompt token is always computed). The answer is cached on the request
    (`request.kv_store_lookup`: blocks [first, first + n) held) until it is admitted, so a
    request that waits several steps costs one lookup. Mutates that cache."""
    bs = kv.block_size
    start = num_computed_tokens // bs
    end = (request.num_tokens - 1) // bs
    if end <= start:
        return 0, False
    cached = request.kv_store_lookup
    looked_up = cached is None or cached[0] > start
    if looked_up:
        hashes = kv.update_block_hashes(request)
        cached = request.kv_store_lookup = (start, lookup(hashes[start:end]))
    first, num_blocks = cached
    return max(0, min(first + num_blocks, end) - start) * bs, looked_up
