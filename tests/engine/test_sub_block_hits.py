"""Sub-block prefix hits (`prefix_match_unit`, kv/partial_hits.py): a multi-turn conversation
reuses its previous turn's partly filled last block by copy-on-write; tokens equal
transformers' with both preemption modes; two requests that share a partial block and then
diverge each get their own tokens."""

from __future__ import annotations

import random

import pytest

from pagedkv import SamplingParams
from tests.engine.conftest import assert_pool_empty, hf_greedy

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

CONFIGS = {
    "unit_1": dict(prefix_match_unit=1),
    "unit_2": dict(prefix_match_unit=2),
    "whole_blocks": dict(),
    "recompute": dict(prefix_match_unit=1, num_gpu_blocks_override=14,
                      preemption_mode="recompute"),
    "swap": dict(prefix_match_unit=1, num_gpu_blocks_override=14, preemption_mode="swap",
                 swap_space=0.01),
}


def _conversations(seed: int, num: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 400) for _ in range(rng.randint(17, 30))] for _ in range(num)]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_multi_turn_reuses_the_partial_block(tiny_llama, make_llm, config):
    llm = make_llm(tiny_llama, block_size=8, **CONFIGS[config])
    unit = CONFIGS[config].get("prefix_match_unit")
    firsts = _conversations(seed=7, num=3)
    turn1 = llm.generate([{"prompt_token_ids": p} for p in firsts], GREEDY, use_tqdm=False)
    rng = random.Random(8)
    seconds = [p + o.outputs[0].token_ids + [rng.randrange(4, 400) for _ in range(5)]
               for p, o in zip(firsts, turn1, strict=True)]
    # Turn 2 decodes longer: its sequences grow by blocks, and preempt each other when tight.
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    turn2 = llm.generate([{"prompt_token_ids": p} for p in seconds], long, use_tqdm=False)
    for prompt, out in zip(firsts, turn1, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, MAX_TOKENS), config
    for prompt, out in zip(seconds, turn2, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, 24), config
    stats = llm.llm_engine.get_stats()
    if config in ("recompute", "swap"):
        assert stats.num_preemptions > 0
        assert config == "recompute" or stats.num_swaps > 0
        assert any(o.num_cached_tokens % 8 for o in turn2)  # sub-block hits under pressure
    else:
        # Turn 1 computed prompt + 5 of its 6 outputs: turn 2 finds all of them cached (in
        # units of `unit`), or only its whole blocks.
        for first, out in zip(firsts, turn2, strict=True):
            computed = len(first) + MAX_TOKENS - 1
            expected = computed - computed % (unit or 8)
            assert out.num_cached_tokens == expected, (config, first)
    assert_pool_empty(llm)


def test_shared_partial_block_then_diverge(tiny_llama, make_llm):
    """Two requests hit the same cached partial block (copied for each) and go different ways:
    each gets its own tokens; the cached block keeps serving a third one."""
    llm = make_llm(tiny_llama, block_size=8, prefix_match_unit=1)
    rng = random.Random(9)
    prefix = [rng.randrange(4, 400) for _ in range(20)]  # 2 full blocks + 4 tokens
    llm.generate({"prompt_token_ids": prefix}, SamplingParams(max_tokens=1), use_tqdm=False)
    b = prefix + [11, 12, 13, 14, 15, 16]
    c = prefix + [21, 22, 23]
    outs = llm.generate([{"prompt_token_ids": b}, {"prompt_token_ids": c}], GREEDY,
                        use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [20, 20]
    for prompt, out in zip((b, c), outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
    d = prefix[:18] + [31, 32]
    out = llm.generate({"prompt_token_ids": d}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 18
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, d, MAX_TOKENS)
    assert_pool_empty(llm)


@pytest.mark.parametrize("unit", [0, 3, 16, 2.0])
def test_bad_prefix_match_unit(tiny_llama, make_llm, unit):
    with pytest.raises(ValueError, match="prefix_match_unit"):
        make_llm(tiny_llama, block_size=8, prefix_match_unit=unit)


@pytest.mark.parametrize("num_blocks", [4, 5])
def test_a_lone_sub_block_hit_at_the_pools_edge_is_admitted(tiny_llama, make_llm, num_blocks):
    """A sub-block hit needs one block more than admission (`can_allocate`) counts: its copy's
    block beside the source it copies. At the pool's edge a lone request whose hit ends inside
    a block must then run with its whole-block hit, never wait for ever (bounded steps)."""
    llm = make_llm(tiny_llama, block_size=8, prefix_match_unit=1, watermark=0.0,
                   num_gpu_blocks_override=num_blocks)
    rng = random.Random(3)
    first = [rng.randrange(4, 400) for _ in range(18)]  # 2 full blocks + 2 tokens cached
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": first}], once, use_tqdm=False)
    second = first + [rng.randrange(4, 400) for _ in range(3)]  # 21 + 3 tokens: 3 blocks
    engine = llm.llm_engine
    engine.add_request("edge", {"prompt_token_ids": second},
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    finished = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        finished += [o for o in engine.step() if o.finished]
    assert not engine.has_unfinished_requests(), "the request never got its blocks"
    assert [o.request_id for o in finished] == ["edge"]
    assert finished[0].outputs[0].token_ids == hf_greedy(tiny_llama, second, 3)
    assert finished[0].num_cached_tokens >= 16  # at least the whole-block hit
