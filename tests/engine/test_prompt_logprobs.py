"""Prompt logprobs through the engine equal transformers' log-softmax of its own logits, whatever
the chunking, and a request that wants them computes its whole prompt (no prefix-cache hit)."""

from __future__ import annotations

import pytest
import torch

from pagedkv import SamplingParams
from tests.engine.conftest import _hf_model, make_prompts

TOP_N = 3


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is the log-softmax that scores prompt token i + 1."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


def assert_matches_reference(model_dir, prompt: list[int], got, top_n: int) -> None:
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for i, entry in enumerate(got[1:]):
        target = prompt[i + 1]
        assert entry[target] == pytest.approx(float(ref[i, target]), abs=1e-4)
        top = ref[i].topk(top_n)
        for tok, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert entry[tok] == pytest.approx(value, abs=1e-4)
        assert set(entry) == set(top.indices.tolist()) | {target}


@pytest.mark.parametrize("config", [dict(), dict(max_num_batched_tokens=8, block_size=4)],
                         ids=["one_chunk", "chunked_prefill"])
def test_prompt_logprobs_match_transformers(tiny_llama, make_llm, config):
    prompts = make_prompts(seed=5, vocab=400, num=3, lengths=(5, 30))
    llm = make_llm(tiny_llama, dtype="float32", **config)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP_N, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_matches_reference(tiny_llama, prompt, output.prompt_logprobs, TOP_N)
        assert len(output.outputs[0].token_ids) == 2


def test_prompt_logprobs_zero_gives_only_the_prompt_token(tiny_llama, make_llm):
    prompt = make_prompts(seed=6, vocab=400, num=1, shared_prefix=0, lengths=(12, 12))[0]
    llm = make_llm(tiny_llama, dtype="float32")
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert_matches_reference(tiny_llama, prompt, out.prompt_logprobs, 0)
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])


def test_no_prefix_hit_for_prompt_logprobs_but_blocks_cached_for_others(tiny_llama, make_llm):
    prompt = make_prompts(seed=7, vocab=400, num=1, shared_prefix=0, lengths=(33, 33))[0]
    llm = make_llm(tiny_llama, dtype="float32", block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    wants = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    first = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    # Every block of the prompt is cached now; the prompt-logprobs request must ignore them.
    second = llm.generate({"prompt_token_ids": prompt}, wants, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0
    assert_matches_reference(tiny_llama, prompt, second.prompt_logprobs, 1)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # ... and its own blocks are cached for the requests that come after it.
    third = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    assert third.num_cached_tokens == 32
    assert first.prompt_logprobs is None and third.prompt_logprobs is None


def test_prompt_logprobs_in_a_mixed_batch_with_n_and_preemption(tiny_llama, make_llm):
    prompts = make_prompts(seed=8, vocab=400, num=4, lengths=(20, 40))
    llm = make_llm(tiny_llama, dtype="float32", block_size=4, num_gpu_blocks_override=36,
                   max_num_batched_tokens=16)
    wants = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, prompt_logprobs=2,
                           ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [wants if i % 2 == 0 else plain for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        if i % 2 == 0:
            assert_matches_reference(tiny_llama, prompt, output.prompt_logprobs, 2)
            assert len(output.outputs) == 2
        else:
            assert output.prompt_logprobs is None
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
