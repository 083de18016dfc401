"""Models mixing attention types run on KV cache groups (kv/coordinator.py): greedy tokens equal
transformers' with prefix caching, chunked prefill and both preemption modes, the sliding
groups really give back the blocks that left the window, and the pool comes back whole."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.kv.coordinator import HybridKVCacheManager
from pagedkv.kv.hashing import group_key_suffix
from pagedkv.kv.manager import KVCacheManager
from tests.engine.conftest import assert_pool_empty, hf_greedy, make_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

CONFIGS = {
    "prefix_caching": dict(block_size=4),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=8),
    "preempt_recompute": dict(block_size=4, max_num_batched_tokens=8,
                              preemption_mode="recompute"),
    "preempt_swap": dict(block_size=4, max_num_batched_tokens=8, preemption_mode="swap",
                         swap_space=0.01),
}
# Room for about two sequences at once (so the six requests preempt each other).
TIGHT_BLOCKS = {"tiny_gemma2": 44, "tiny_gemma3": 64}


@pytest.mark.parametrize("model", ["tiny_gemma2", "tiny_gemma3"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_grouped_models_match_transformers(request, make_llm, model, config):
    model_dir = request.getfixturevalue(model)
    prompts = make_prompts(seed=5, vocab=400, num=6, lengths=(5, 40))
    kwargs = dict(CONFIGS[config])
    if config.startswith("preempt"):
        kwargs["num_gpu_blocks_override"] = TIGHT_BLOCKS[model]
    llm = make_llm(model_dir, **kwargs)
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    assert [g.sliding_window for g in kv.groups] == \
        ([None, 8] if model == "tiny_gemma2" else [None] + [8] * 5)
    # The first prompt runs alone, so its blocks are cached when the others arrive.
    outputs = [o for batch in (prompts[:1], prompts[1:])
               for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY,
                                     use_tqdm=False)]
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS), config
    stats = llm.llm_engine.get_stats()
    if config.startswith("preempt"):
        assert stats.num_preemptions > 0
        if config == "preempt_swap":
            assert stats.num_swaps > 0
    else:
        assert stats.prefix_cache_hits > 0
        assert sum(o.num_cached_tokens for o in outputs) == stats.prefix_cache_hits
    assert_pool_empty(llm)


def test_sliding_groups_hold_only_the_window(make_llm, tiny_gemma3):
    """A 60-token sequence: the full group keeps all 15 blocks (block 4), each sliding group
    (window 8) only the blocks the next token still sees, the rest nulled and back in the pool."""
    llm = make_llm(tiny_gemma3, block_size=4, enable_prefix_caching=False)
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    prompt = make_prompts(seed=6, vocab=400, num=1, shared_prefix=0, lengths=(59, 59))[0]
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()  # the prompt, and its first token
    engine.step()  # position 59: the next one to compute is 60
    tables = kv.get_group_block_ids("r")
    assert len(tables[0]) == 15 and 0 not in tables[0]
    for table in tables[1:]:
        live = [b for b in table if b != 0]
        # positions 53..60 are in the window of position 60: blocks 13 and 14 (and 15 later)
        assert table[:13] == [0] * 13 and len(live) == len(table) - 13
    held = kv.num_usable_blocks - kv.num_free_blocks
    assert held == sum(len([b for b in t if b != 0]) for t in tables)
    assert held < 15 * len(tables) // 3  # all-full would hold 15 blocks per group
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(llm)


def test_disable_hybrid_kv_cache_manager_keeps_full_blocks(make_llm, tiny_gemma3):
    """vLLM's switch: one group of full-attention blocks on every layer; same tokens."""
    llm = make_llm(tiny_gemma3, block_size=4, disable_hybrid_kv_cache_manager=True)
    engine = llm.llm_engine
    assert type(engine.scheduler.kv_cache_manager) is KVCacheManager
    assert engine.runner.layer_groups is None
    assert engine.runner.kv_cache_spec.kind == "full_attention"
    prompts = make_prompts(seed=5, vocab=400, num=3, lengths=(5, 40))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(tiny_gemma3, prompt, MAX_TOKENS)
    assert_pool_empty(llm)


@pytest.mark.timeout(60)
def test_a_prompt_whose_prefill_can_never_fit_ends_with_an_error(make_llm, tiny_gemma3):
    """Admission counts a prefill chunk in every sliding group: a prompt whose one-step prefill
    needs more blocks than the cache has is refused (NEVER), not left waiting forever."""
    llm = make_llm(tiny_gemma3, block_size=4, num_gpu_blocks_override=40)
    out = llm.generate({"prompt_token_ids": list(range(10, 70))}, GREEDY, use_tqdm=False)[0]
    assert out.finished and out.outputs[0].finish_reason == "error"
    # The same prompt in chunks of 8 tokens fits: 15 full blocks + 5 x (3 + 2) sliding ones.
    llm = make_llm(tiny_gemma3, block_size=4, num_gpu_blocks_override=41,
                   max_num_batched_tokens=8)
    prompt = list(range(10, 70))
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_gemma3, prompt, MAX_TOKENS)
    assert_pool_empty(llm)


# Each attention path (Gemma 3's, Gemma 2's soft-capped one) with each kind of quantized block
# (fp8 with per-head scales, int8 with per-token scales). fp8_e5m2 takes fp8's path with
# another dtype, run on Gemma 2's groups by the prefix-hit test below and
# tests/model/test_softcap_quantized.py, through swap and recompute by test_kv_cache_dtype.py.
@pytest.mark.parametrize("model, cache_dtype", [
    ("tiny_gemma3", "fp8"), ("tiny_gemma3", "int8"),
    ("tiny_gemma2", "fp8"), ("tiny_gemma2", "int8")])
def test_quantized_kv_cache_with_groups(request, make_llm, model, cache_dtype):
    """fp8 and int8 caches on KV cache groups: every group's slots hold their own layer's
    quantized KV (int8: with its per-token scales, copied with the blocks), so prefix hits,
    chunked prefill, recompute and swap give the same tokens, each within the quantized
    cache's logit bound of the grouped model-dtype cache's best (as for one group). Gemma 2's
    soft-capped attention stores and reads the quantized blocks itself (softcap_attention.py)."""
    from tests.engine.test_kv_cache_dtype import BOUNDS, _assert_near_best

    model_dir = request.getfixturevalue(model)
    prompts = make_prompts(seed=5, vocab=400, num=6, lengths=(5, 40))
    runs = {}
    for config in sorted(CONFIGS):
        kwargs = dict(CONFIGS[config], kv_cache_dtype=cache_dtype)
        if config.startswith("preempt"):
            kwargs["num_gpu_blocks_override"] = TIGHT_BLOCKS[model]
        llm = make_llm(model_dir, **kwargs)
        assert isinstance(llm.llm_engine.scheduler.kv_cache_manager, HybridKVCacheManager)
        outputs = [o for batch in (prompts[:1], prompts[1:])
                   for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY,
                                         use_tqdm=False)]
        runs[config] = [list(o.outputs[0].token_ids) for o in outputs]
        stats = llm.llm_engine.get_stats()
        assert (stats.num_preemptions if config.startswith("preempt")
                else stats.prefix_cache_hits) > 0, config
        assert_pool_empty(llm)
    for config, tokens in runs.items():
        assert tokens == runs["prefix_caching"], config
    exact = sum(_assert_near_best(model_dir, p, t, BOUNDS[cache_dtype])
                for p, t in zip(prompts, runs["prefix_caching"], strict=True))
    assert exact >= 0.9 * len(prompts) * MAX_TOKENS


def test_pinned_prefix_with_groups_survives_a_flood(make_llm, tiny_gemma3):
    """`LLM.pin_prefix` on Gemma 3 (block 4, window 8): the pin holds the full group's 10
    prefix blocks and each of the 5 sliding groups' last 2; a flood of other prompts evicts
    everything else, and the pinned prefix still hits whole with transformers' tokens."""
    llm = make_llm(tiny_gemma3, block_size=4, num_gpu_blocks_override=80,
                   max_num_batched_tokens=8)
    engine = llm.llm_engine
    pinned = list(range(11, 51))  # 10 full blocks
    info = llm.pin_prefix({"prompt_token_ids": pinned})
    assert (info.num_blocks, info.num_tokens, info.num_prompt_blocks) == (10 + 5 * 2, 40, 10)
    flood = make_prompts(seed=8, vocab=400, num=6, shared_prefix=0, lengths=(40, 40))
    llm.generate([{"prompt_token_ids": p} for p in flood], GREEDY, use_tqdm=False)
    engine.check_invariants()
    kv = engine.scheduler.kv_cache_manager
    hashes = kv.pins._hashes(pinned, None)
    sliding = group_key_suffix(1)
    assert kv.pool.get_cached_block(hashes[0] + sliding) is None  # evicted: not pinned
    assert kv.pool.get_cached_block(hashes[9] + sliding) is not None  # pinned
    prompt = pinned + [300, 301, 302]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == hf_greedy(tiny_gemma3, prompt, MAX_TOKENS)
    assert llm.unpin_prefix({"prompt_token_ids": pinned}).total_pinned_blocks == 0
    assert_pool_empty(llm)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2", "int8"])
def test_softcapped_quantized_cache_prefix_hit_and_copy_on_write(make_llm, tiny_gemma2,
                                                                 cache_dtype):
    """Gemma 2 over a quantized cache: a prompt whose 40-token prefix is a cache hit decodes
    the same tokens with exactly the same logprobs as with no prefix caching (the cached
    blocks are read back as they were written), and n=3 greedy samples forked on the prompt's blocks
    (the last one copied on write, int8 with its scales) all equal the single sample."""
    prompts = make_prompts(seed=7, vocab=400, num=3, lengths=(6, 10))  # 0 and 2 share 40
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=3)
    outs = {}
    for caching in (True, False):
        llm = make_llm(tiny_gemma2, block_size=4, kv_cache_dtype=cache_dtype,
                       enable_prefix_caching=caching)
        for p in (prompts[0], prompts[2]):  # one at a time: the second hits the first's blocks
            out = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
        outs[caching] = out
        assert out.num_cached_tokens == (40 if caching else 0)
    warm, cold = outs[True].outputs[0], outs[False].outputs[0]
    assert warm.token_ids == cold.token_ids
    if llm.llm_engine.runner.device.type == "cpu":
        assert warm.logprobs == cold.logprobs  # exactly: every top-3 logprob of every step
    else:  # the GPU kernel tiles a cached prefix otherwise than a prompt: float32 sum order
        for w, c in zip(warm.logprobs, cold.logprobs, strict=True):
            assert w.keys() == c.keys()
            assert all(abs(w[t] - c[t]) < 1e-5 for t in w)
    cache = llm.llm_engine.runner.kv_cache
    copies, copy = [], cache.copy
    cache.copy = lambda mapping: (copies.extend(mapping), copy(mapping))
    single = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False)[0]
    forked = llm.generate({"prompt_token_ids": prompts[1]},
                          SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS,
                                         ignore_eos=True), use_tqdm=False)[0]
    assert [list(c.token_ids) for c in forked.outputs] == [list(single.outputs[0].token_ids)] * 3
    assert copies, "no block was copied on write"
