"""long_prefill_token_threshold through the whole engine: prompts prefilled in capped chunks
give the same greedy tokens and logprobs as prompts prefilled at once."""

from __future__ import annotations

from pagedkv import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


def test_capped_prefill_chunks_give_the_same_tokens(tiny_llama, make_llm):
    prompts = [{"prompt_token_ids": [1 + (5 * i + j) % 90 for j in range(37 + 9 * i)]}
               for i in range(3)]
    outputs = {}
    for threshold in (0, 8):
        llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=128, dtype="float32",
                       long_prefill_token_threshold=threshold)
        outputs[threshold] = llm.generate(prompts, PARAMS, use_tqdm=False)
    for whole, chunked in zip(outputs[0], outputs[8], strict=True):
        assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
        for want, got in zip(whole.outputs[0].logprobs, chunked.outputs[0].logprobs, strict=True):
            assert want.keys() == got.keys()
            assert all(abs(want[t] - got[t]) < 1e-4 for t in want)
