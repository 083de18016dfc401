"""Sub-block prefix hits (`prefix_match_unit`) with KV cache groups (kv/coordinator.py): on tiny
Gemma 2 and Gemma 3 (a full group and sliding groups of window 8, smaller than a block) a
follow-up turn reuses the previous turn's partly filled last block in every group by
copy-on-write, `num_cached_tokens` counts it to the token, greedy tokens equal transformers'
under both preemption modes, and two requests sharing a partial block then diverging each get
their own tokens."""

from __future__ import annotations

import random

import pytest

from pagedkv import SamplingParams
from pagedkv.kv.coordinator import HybridKVCacheManager
from tests.engine.conftest import assert_pool_empty, hf_greedy

MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MODELS = ["tiny_gemma2", "tiny_gemma3"]


def _prompts(seed: int, num: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 400) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def _check_pool(llm) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    kv.check_invariants()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_next_turn_hits_inside_a_block(request, make_llm, model, block_size):
    """Turn 1 computed prompt + 3 of its 4 outputs: turn 2 hits all of them, to the token."""
    model_dir = request.getfixturevalue(model)
    llm = make_llm(model_dir, block_size=block_size, prefix_match_unit=1)
    firsts = _prompts(seed=7, num=2, lengths=(block_size + 3, 2 * block_size - 6))
    turn1 = llm.generate([{"prompt_token_ids": p} for p in firsts], GREEDY, use_tqdm=False)
    _check_pool(llm)
    seconds = [p + o.outputs[0].token_ids + [17, 18, 19]
               for p, o in zip(firsts, turn1, strict=True)]
    turn2 = llm.generate([{"prompt_token_ids": p} for p in seconds], GREEDY, use_tqdm=False)
    _check_pool(llm)
    for prompt, out in zip(firsts + seconds, turn1 + turn2, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)
    for first, out in zip(firsts, turn2, strict=True):
        computed = len(first) + MAX_TOKENS - 1
        assert computed % block_size  # the hit really ends inside a block
        assert out.num_cached_tokens == computed
    assert llm.llm_engine.get_stats().prefix_cache_hits == sum(
        o.num_cached_tokens for o in turn1 + turn2)
    assert_pool_empty(llm)


@pytest.mark.parametrize("model", MODELS)
def test_shared_partial_block_then_diverge(request, make_llm, model):
    """Two requests hit the same cached partial block in every group (each gets copies) and go
    different ways: each gets its own tokens; the cached blocks keep serving a third one."""
    model_dir = request.getfixturevalue(model)
    llm = make_llm(model_dir, block_size=16, prefix_match_unit=1)
    prefix = _prompts(seed=9, num=1, lengths=(40, 40))[0]  # 2 full blocks + 8 tokens
    llm.generate({"prompt_token_ids": prefix}, SamplingParams(max_tokens=1), use_tqdm=False)
    b, c = prefix + [11, 12, 13, 14, 15, 16], prefix + [21, 22, 23]
    outs = llm.generate([{"prompt_token_ids": b}, {"prompt_token_ids": c}], GREEDY,
                        use_tqdm=False)
    _check_pool(llm)
    assert [o.num_cached_tokens for o in outs] == [40, 40]
    d = prefix[:37] + [31, 32]
    out = llm.generate({"prompt_token_ids": d}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 37
    for prompt, o in zip((b, c, d), (*outs, out), strict=True):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)
    assert_pool_empty(llm)


# Room for about two conversations at once (so turn 2's long decodes preempt each other).
TIGHT_BLOCKS = {"tiny_gemma2": 14, "tiny_gemma3": 40}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sub_block_hits_under_preemption(request, make_llm, model, mode):
    model_dir = request.getfixturevalue(model)
    llm = make_llm(model_dir, block_size=16, prefix_match_unit=1, preemption_mode=mode,
                   num_gpu_blocks_override=TIGHT_BLOCKS[model],
                   **({"swap_space": 0.01} if mode == "swap" else {}))
    firsts = _prompts(seed=11, num=3, lengths=(18, 28))
    turn1 = llm.generate([{"prompt_token_ids": p} for p in firsts], GREEDY, use_tqdm=False)
    seconds = [p + o.outputs[0].token_ids + [17, 18]
               for p, o in zip(firsts, turn1, strict=True)]
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    turn2 = llm.generate([{"prompt_token_ids": p} for p in seconds], long, use_tqdm=False)
    _check_pool(llm)
    for prompt, out in zip(firsts, turn1, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)
    for prompt, out in zip(seconds, turn2, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 24)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert mode == "recompute" or stats.num_swaps > 0
    # sub-block hits under pressure
    assert any(o.num_cached_tokens % 16 for o in turn2), [o.num_cached_tokens for o in turn2]
    assert_pool_empty(llm)
