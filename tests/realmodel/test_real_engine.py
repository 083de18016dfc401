"""The engine on the real model (SmolLM2-135M, GGUF) equals transformers on the same weights:
greedy tokens and logprobs, under prefix caching, chunked prefill, both preemption modes,
n > 1 and tensor parallelism (3 ranks: the model's 9 heads do not split in 2). One engine per
memory setting (the roomy one shared with the other real-model modules), short prompts, few
tokens."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from tests.engine.conftest import assert_pool_empty
from tests.realmodel.conftest import (
    MAX_TOKENS,
    PROMPTS,
    TOP,
    assert_logprobs_match,
    hf_greedy,
    hf_logprobs,
)

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
# Three prompts of 6-8 tokens growing by 8 need 4 blocks of 4 tokens each; 9 blocks hold two,
# so the third preempts. 8-token steps chunk every prompt's prefill.
TIGHT = dict(dtype="float32", block_size=4, num_gpu_blocks_override=9, max_num_batched_tokens=8,
             max_model_len=64, swap_space=0.01)


@pytest.fixture(scope="module")
def reference(hf_real_model, real_model_path):
    """Each prompt's token ids and transformers' greedy continuation of it."""
    from pagedkv.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(real_model_path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    return [(p, hf_greedy(hf_real_model, p, MAX_TOKENS)) for p in prompts]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_and_logprobs_under_pressure(real_model_path, make_llm, hf_real_model,
                                            reference, preemption_mode):
    llm = make_llm(real_model_path, preemption_mode=preemption_mode, **TIGHT)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in reference], GREEDY,
                           use_tqdm=False)
    for (prompt, want), output in zip(reference, outputs, strict=True):
        got = output.outputs[0]
        assert got.token_ids == want, (preemption_mode, llm.get_tokenizer().decode(want))
        assert_logprobs_match(hf_logprobs(hf_real_model, prompt, want), want, got.logprobs)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    # Again: the prompts' full blocks are cached now, and the tokens are the same.
    prompt, want = reference[0]
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want
    assert_pool_empty(llm)


def test_n_samples_logprobs_equal_transformers(real_llm, hf_real_model, reference):
    llm = real_llm
    prompt, _ = reference[1]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True,
                            logprobs=TOP)
    samples = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs
    assert len(samples) == 3 and len({tuple(s.token_ids) for s in samples}) > 1
    for sample in samples:
        reference_lp = hf_logprobs(hf_real_model, prompt, sample.token_ids)
        assert_logprobs_match(reference_lp, sample.token_ids, sample.logprobs)


def test_chat_answers_in_english(real_llm):
    out = real_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the turn


def test_tensor_parallel_equals_transformers(real_model_path, make_llm, reference):
    # SmolLM2-135M has 9 attention heads and 3 KV heads: 3 ranks is its smallest split.
    llm = make_llm(real_model_path, dtype="float32", block_size=4, max_model_len=64,
                   tensor_parallel_size=3, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in reference], params,
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [want for _, want in reference]
