"""Speculative decoding (n-gram prompt lookup) through the engine: greedy tokens equal to no
speculation (and to transformers') for every registered architecture; the same with preemption
(recompute, swap), prefix-cache hits, chunked prefill, stop strings, stop tokens, max_tokens
and logprobs; the KV pool and the prefix cache exactly as without speculation once requests
finish (invariants checked every step); seeded sampling reproducible; the core process."""

from __future__ import annotations

import random

import pytest

from pagedkv import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.conftest import hf_greedy

pytestmark = pytest.mark.timeout(240)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def repeating_prompts(num: int, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    """Prompts that quote themselves (a random phrase three times): the proposer proposes."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrase = [rng.randrange(4, vocab) for _ in range(rng.randint(6, 12))]
        prompts.append(phrase * 3 + phrase[:3])
    return prompts


def generate(llm: LLM, prompts: list[list[int]], params) -> list:  # noqa: ANN001
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def check_every_step(llm: LLM) -> None:
    """Check the scheduler's and the block pool's invariants after every applied step."""
    scheduler = llm.llm_engine.core.scheduler
    update = scheduler.update

    def checked(out, result):  # noqa: ANN001, ANN202
        changed = update(out, result)
        scheduler.check_invariants()
        return changed

    scheduler.update = checked


def spec_stats(llm: LLM):  # noqa: ANN201
    return llm.llm_engine.get_stats()


def assert_some_accepted_some_rejected(llm: LLM) -> None:
    stats = spec_stats(llm)
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_greedy_tokens_equal_no_speculation_for_every_architecture(tiny_model, make_llm):
    prompts = repeating_prompts(4, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks_override=120, max_model_len=128)
    expected = [o.token_ids for o in generate(make_llm(tiny_model, **kw), prompts, params)]
    spec = make_llm(tiny_model, speculative_config=NGRAM, **kw)
    check_every_step(spec)
    got = [o.token_ids for o in generate(spec, prompts, params)]
    assert got == expected
    assert got[0] == hf_greedy(tiny_model, prompts[0], 20)
    assert_some_accepted_some_rejected(spec)


def cached_hashes(llm: LLM) -> set:
    return set(llm.llm_engine.core.scheduler.kv_cache_manager.pool.cached_block_hash_to_block)


def test_pool_and_prefix_cache_as_without_speculation(tiny_llama, make_llm):
    prompts = repeating_prompts(6, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks_override=400, max_model_len=128)
    plain, spec = make_llm(tiny_llama, **kw), make_llm(tiny_llama, speculative_config=NGRAM, **kw)
    check_every_step(spec)
    assert [o.token_ids for o in generate(spec, prompts, params)] == \
        [o.token_ids for o in generate(plain, prompts, params)]
    assert_some_accepted_some_rejected(spec)
    for llm in (plain, spec):
        kv = llm.llm_engine.core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_usable_blocks
    assert cached_hashes(spec) == cached_hashes(plain)
    assert cached_hashes(spec)


def mixed_params(stop_text: str, stop_token: int) -> list[SamplingParams]:
    """Per request, in turn: a stop string and a stop token (both in the first prompt's
    greedy output), logprobs, max_tokens, no stop."""
    return [
        SamplingParams(temperature=0.0, max_tokens=22, stop=[stop_text]),
        SamplingParams(temperature=0.0, max_tokens=22, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True),
    ]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_same_outputs_with_preemption_chunked_prefill_stops_and_logprobs(
        tiny_llama, make_llm, preemption_mode):
    # 36 blocks of 4 tokens for 10 requests of up to ~40 + 22 tokens: requests are preempted;
    # pairs share their prompt (prefix-cache hits); a 16-token budget chunks the prefills.
    prompts = [p for p in repeating_prompts(5, seed=3) for _ in range(2)]
    kw = dict(block_size=4, num_gpu_blocks_override=36, max_model_len=128,
              preemption_mode=preemption_mode, swap_space=0.01, max_num_batched_tokens=16)
    plain = make_llm(tiny_llama, **kw)
    probe = generate(plain, prompts[:1], SamplingParams(temperature=0.0, max_tokens=22,
                                                        ignore_eos=True))[0]
    stop_text, stop_token = probe.text[6:9], probe.token_ids[9]
    params = [mixed_params(stop_text, stop_token)[i % 5] for i in range(len(prompts))]
    expected = generate(plain, prompts, params)
    spec = make_llm(tiny_llama, speculative_config=NGRAM, **kw)
    check_every_step(spec)
    got = generate(spec, prompts, params)
    for g, e in zip(got, expected, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (e.token_ids, e.text, e.finish_reason, e.stop_reason)
        if e.logprobs:
            assert len(g.logprobs) == len(e.logprobs)
            for gl, el in zip(g.logprobs, e.logprobs, strict=True):
                assert set(gl) == set(el)
                assert [gl[t] for t in gl] == pytest.approx(
                    [el[t] for t in gl], abs=1e-4)
    stats = spec_stats(spec)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    if preemption_mode == "swap":
        assert stats.num_swaps > 0
    assert_some_accepted_some_rejected(spec)
    assert expected[0].finish_reason == "stop" and expected[0].stop_reason == stop_text
    assert expected[1].stop_reason == stop_token and len(expected[1].token_ids) <= 10
    assert len(expected[3].token_ids) == 7


def test_seeded_sampling_is_reproducible_and_uses_speculation(tiny_llama, make_llm):
    prompts = repeating_prompts(3, seed=4)
    params = SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=20, ignore_eos=True,
                            n=2)
    kw = dict(block_size=4, num_gpu_blocks_override=120, max_model_len=128)
    runs = []
    for _ in range(2):
        llm = make_llm(tiny_llama, speculative_config=NGRAM, **kw)
        check_every_step(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        assert spec_stats(llm).spec_decode_num_drafts > 0
    assert runs[0] == runs[1]
    assert all(len(t) == 20 for samples in runs[0] for t in samples)
    assert any(samples[0] != samples[1] for samples in runs[0])  # each sample its own stream


def test_core_process_gives_the_in_process_tokens_and_counts(tiny_llama, make_llm):
    prompts = repeating_prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(block_size=4, num_gpu_blocks_override=120, max_model_len=128,
              speculative_config=NGRAM)
    inproc = make_llm(tiny_llama, **kw)
    expected = [o.token_ids for o in generate(inproc, prompts, params)]
    llm = LLM(str(tiny_llama), core_process=True, seed=0, **kw)
    try:
        assert [o.token_ids for o in generate(llm, prompts, params)] == expected
        stats, local = llm.llm_engine.get_stats(), spec_stats(inproc)
        assert stats.spec_decode_num_drafts == local.spec_decode_num_drafts > 0
        assert stats.spec_decode_num_accepted_tokens == local.spec_decode_num_accepted_tokens
        assert list(stats.spec_decode_accepted_per_pos) == \
            list(local.spec_decode_accepted_per_pos)
    finally:
        llm.shutdown()


def test_a_stop_string_inside_an_accepted_run_cuts_the_tokens_there(tiny_llama, make_llm):
    prompt = repeating_prompts(1, seed=6)[0]
    kw = dict(block_size=4, num_gpu_blocks_override=200, max_model_len=128)
    plain = make_llm(tiny_llama, **kw)
    text = generate(plain, [prompt], SamplingParams(temperature=0.0, max_tokens=30,
                                                     ignore_eos=True))[0].text
    params = [SamplingParams(temperature=0.0, max_tokens=30, stop=[text[k:k + 2]])
              for k in range(4, 40, 3)]
    expected = generate(plain, [prompt] * len(params), params)
    spec = make_llm(tiny_llama, speculative_config=NGRAM, **kw)
    got = generate(spec, [prompt] * len(params), params)
    assert [(g.token_ids, g.text, g.stop_reason) for g in got] == \
        [(e.token_ids, e.text, e.stop_reason) for e in expected]
    assert all(e.finish_reason == "stop" for e in expected[:3])
    stats = spec_stats(spec)
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens


def test_structured_outputs_masked_at_every_verified_position(tiny_llama, make_llm):
    # The drafts of a constrained request are cut where its grammar refuses them, every
    # verified position is masked with the grammar's state there, and the grammar advances
    # per accepted token: the same tokens as without speculation.
    prompts = repeating_prompts(4, seed=7)
    kw = dict(block_size=4, num_gpu_blocks_override=160, max_model_len=128)
    constraints = [StructuredOutputsParams(regex=r"(ab-|cd-){8}"),
                   StructuredOutputsParams(regex=r"[a-c]{4}-\d{3}"),
                   StructuredOutputsParams(choice=["one two one two one two", "three"])]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
              for c in constraints]
    params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))  # beside
    expected = generate(make_llm(tiny_llama, **kw), prompts, params)
    spec = make_llm(tiny_llama, speculative_config=NGRAM, **kw)
    check_every_step(spec)
    got = generate(spec, prompts, params)
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == \
        [(e.token_ids, e.text, e.finish_reason) for e in expected]
    assert all(e.finish_reason == "stop" for e in expected[:3])
    stats = spec_stats(spec)
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
