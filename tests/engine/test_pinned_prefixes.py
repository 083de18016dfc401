"""Pinned prefixes through the engine, under every eviction policy: a pinned prefix survives a
flood of other prompts that evicts it when unpinned, its hits give the reference model's tokens,
unpin makes it evictable again, the bound holds, reset_prefix_cache keeps it; the block pool's
invariants are checked after every engine step."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.kv.eviction import EVICTION_POLICIES
from pagedkv.kv.pins import NotPinnedError
from tests.engine.conftest import hf_greedy

BLOCK = 4
NUM_BLOCKS = 33  # 32 usable blocks of 4 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PINNED = [11 + i for i in range(12)]  # 3 full blocks
QUESTION = [300, 301, 302]


def _flood(seed: int) -> list[list[int]]:
    """One-off prompts of 6 full blocks each: 12 of them are more than twice the cache."""
    return [[(seed * 1000 + i * 37 + j) % 390 + 5 for j in range(24)] + [1] for i in range(12)]


def _run(engine, prompts, prefix: str) -> list:
    """Run `prompts` to completion, checking the pool after every step; finished outputs."""
    ids = []
    for i, prompt in enumerate(prompts):
        ids.append(f"{prefix}{i}")
        engine.add_request(ids[-1], {"prompt_token_ids": prompt}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    return [done[i] for i in ids]


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_pinned_prefix_survives_a_flood(tiny_llama, make_llm, policy):
    llm = make_llm(tiny_llama, block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                   eviction_policy=policy, max_num_seqs=4)
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    info = llm.pin_prefix({"prompt_token_ids": PINNED})  # not cached yet: runs it, then pins
    assert (info.num_blocks, info.num_tokens, info.num_prompt_blocks) == (3, 12, 3)
    assert kv.num_pinned_blocks == 3 and engine.get_stats().num_pinned_blocks == 3
    assert llm.pin_prefix({"prompt_token_ids": PINNED}) == info  # idempotent
    _run(engine, _flood(1), "flood")
    [out] = _run(engine, [PINNED + QUESTION], "after")
    assert out.num_cached_tokens == 12
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, PINNED + QUESTION, 4)

    # Unpinned, the same blocks are free and cached; a flood needing every block evicts them.
    assert llm.unpin_prefix({"prompt_token_ids": PINNED}).num_blocks == 0
    assert kv.num_pinned_blocks == 0 and kv.num_free_blocks == kv.num_usable_blocks
    with pytest.raises(NotPinnedError, match="not pinned"):
        llm.unpin_prefix({"prompt_token_ids": PINNED})
    _run(engine, [[(7 * j) % 390 + 5 for j in range(NUM_BLOCKS * BLOCK - 2 * BLOCK)]], "all")
    [out] = _run(engine, [PINNED + QUESTION], "gone")
    assert out.num_cached_tokens == 0


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_the_flood_evicts_an_unpinned_prefix(tiny_llama, make_llm, policy):
    """The control: unpinned (and used once, as the pin's own prefill uses it), the same flood
    leaves nothing of the prefix under any policy."""
    llm = make_llm(tiny_llama, block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                   eviction_policy=policy, max_num_seqs=4)
    engine = llm.llm_engine
    _run(engine, [PINNED + [2]], "warm")
    _run(engine, _flood(1), "flood")
    [out] = _run(engine, [PINNED + QUESTION], "after")
    assert out.num_cached_tokens == 0


def test_pin_bound_salt_and_reset(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                   max_pinned_fraction=0.25)  # at most 8 of 32 blocks
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    assert kv.pins.max_blocks == 8
    long_prompt = [40 + i for i in range(36)]  # 9 full blocks
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        llm.pin_prefix({"prompt_token_ids": long_prompt})
    assert kv.num_pinned_blocks == 0
    assert llm.pin_prefix({"prompt_token_ids": long_prompt[:32]}).num_blocks == 8
    # The same tokens salted differently are another prefix: no room left for it.
    with pytest.raises(ValueError, match="max_pinned_fraction"):
        llm.pin_prefix({"prompt_token_ids": long_prompt[:8]}, cache_salt="tenant-b")
    # A shorter unsalted prompt shares the pinned blocks: they count once.
    assert llm.pin_prefix({"prompt_token_ids": long_prompt[:8]}).total_pinned_blocks == 8
    with pytest.raises(ValueError, match="no full block"):
        engine.pin_prefix({"prompt_token_ids": [1, 2, 3]})
    with pytest.raises(ValueError, match="cache_salt"):
        engine.pin_prefix({"prompt_token_ids": long_prompt}, cache_salt=5)
    # reset_prefix_cache keeps pinned blocks (and only them).
    _run(engine, [[200 + i for i in range(9)]], "other")
    assert kv.reset_prefix_cache()
    assert len(kv.pool.cached_block_hash_to_block) == 8
    engine.check_invariants()
    [out] = _run(engine, [long_prompt[:32] + [9]], "hit")
    assert out.num_cached_tokens == 32
    llm.unpin_prefix({"prompt_token_ids": long_prompt[:8]})
    llm.unpin_prefix({"prompt_token_ids": long_prompt[:32]})
    assert kv.num_pinned_blocks == 0
