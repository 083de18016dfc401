"""Lookahead slots (`allocate_slots(..., num_lookahead_tokens)`): room for speculative tokens
being verified, never cached by the call; the rejected ones' blocks given back by
`trim_blocks`, and only blocks full of accepted tokens cached."""

from __future__ import annotations

from pagedkv.kv.manager import KVCacheManager
from tests.kv.conftest import make_request, prefill

BS = 4


def decoding_request(m: KVCacheManager):  # noqa: ANN201
    """A request past its prefill: 6 prompt tokens computed, its first output token sampled."""
    r = make_request("r", range(10, 16))
    prefill(m, r)
    r.append(50)
    return r


def verify(m: KVCacheManager, r, drafts: list[int], emitted: list[int]) -> None:  # noqa: ANN001
    """One verifying step as the scheduler applies it: `emitted` = accepted drafts + 1."""
    assert m.allocate_slots(r, 1, delay_cache_blocks=True,
                            num_lookahead_tokens=len(drafts)) is not None
    assert len(m.get_block_ids("r")) * BS >= r.num_computed_tokens + 1 + len(drafts)
    m.check_invariants()
    for token in emitted:
        r.append(token)
    r.num_computed_tokens += len(emitted)
    m.trim_blocks(r, r.num_tokens)
    m.cache_blocks(r, r.num_computed_tokens)
    m.check_invariants()


def test_rejected_drafts_give_their_blocks_back_and_are_never_cached():
    m = KVCacheManager(num_blocks=17, block_size=BS, watermark=0.0)
    r = decoding_request(m)
    assert len(m.get_block_ids("r")) == 2 and m.num_free_blocks == 14
    # Positions 6..9: the lookahead takes block 2 (positions 8, 9) on top of the two held.
    verify(m, r, [60, 61, 62], emitted=[70])  # all three rejected
    assert r.num_computed_tokens == 7 and r.num_tokens == 8
    assert len(m.get_block_ids("r")) == 2 and m.num_free_blocks == 14  # block 2 back
    assert m.pool.cached_block_hash_to_block.keys() == set(m.get_block_hashes("r")[:1])
    m.free(r)
    assert m.num_free_blocks == 16
    m.check_invariants()


def test_accepted_drafts_keep_their_slots_and_fill_cached_blocks():
    m = KVCacheManager(num_blocks=17, block_size=BS, watermark=0.0)
    r = decoding_request(m)
    verify(m, r, [60, 61, 62], emitted=[60, 61, 62, 63])  # all accepted, plus the bonus
    assert r.num_computed_tokens == 10 and r.num_tokens == 11
    assert len(m.get_block_ids("r")) == 3
    hashes = m.get_block_hashes("r")
    assert len(hashes) == 2  # the two full blocks of accepted tokens: cached
    assert m.pool.cached_block_hash_to_block.keys() == set(hashes)


def test_lookahead_counts_against_the_free_blocks():
    m = KVCacheManager(num_blocks=4, block_size=BS, watermark=0.0)  # 3 usable blocks
    r = decoding_request(m)  # holds 2
    assert m.allocate_slots(r, 1, delay_cache_blocks=True, num_lookahead_tokens=6) is None
    assert len(m.get_block_ids("r")) == 2  # nothing taken
    assert m.allocate_slots(r, 1, delay_cache_blocks=True, num_lookahead_tokens=5) is not None
    assert len(m.get_block_ids("r")) == 3
    m.check_invariants()
