"""logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens through the engine."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.sched.request import Request
from pagedkv.sched.scheduler import bad_word_bans
from tests.engine.conftest import hf_greedy

PROMPT = [5, 17, 99, 230, 41, 8, 77]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kw)


def test_logit_bias(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    out = llm.generate({"prompt_token_ids": PROMPT}, greedy(logit_bias={42: 100.0}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [42] * 6
    reference = hf_greedy(tiny_llama, PROMPT, 6)
    out = llm.generate({"prompt_token_ids": PROMPT}, greedy(logit_bias={reference[0]: -100.0}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids[0] != reference[0]
    # A bias of 0 changes nothing.
    out = llm.generate({"prompt_token_ids": PROMPT}, greedy(logit_bias={reference[0]: 0}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference


def test_allowed_token_ids(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    allowed = [10, 20, 30]
    params = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=20, ignore_eos=True,
                            allowed_token_ids=allowed)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    tokens = [t for c in out.outputs for t in c.token_ids]
    assert len(tokens) == 60 and set(tokens) <= set(allowed) and len(set(tokens)) > 1
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_bad_words(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32")
    engine = llm.llm_engine
    reference = hf_greedy(tiny_llama, PROMPT, 6)
    word = engine.tokenizer.decode(reference[:1]).strip() or "x"
    sequences = engine.bad_words_token_ids([word])
    out = llm.generate({"prompt_token_ids": PROMPT}, greedy(bad_words=[word]),
                       use_tqdm=False)[0].outputs[0].token_ids
    for seq in sequences:
        assert not any(out[i:i + len(seq)] == seq for i in range(len(out)))
    if any(reference[:len(s)] == s for s in sequences):
        assert out != reference


def test_bad_word_rule():
    req = Request("r", [1, 2], SamplingParams())
    req.bad_words_token_ids = [[7], [3, 4], [5, 6, 8]]
    assert bad_word_bans(req) == [7]
    for t in (9, 5, 6):
        req.append_output_token(t)
    assert bad_word_bans(req) == [7, 8]
    req.append_output_token(3)
    assert bad_word_bans(req) == [7, 4]


def test_truncate_prompt_tokens(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, dtype="float32", max_model_len=64)
    long_prompt = list(range(3, 203))  # 200 tokens > max_model_len
    out = llm.generate({"prompt_token_ids": long_prompt}, greedy(truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt[-5:]
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, long_prompt[-5:], 6)
    out = llm.generate({"prompt_token_ids": long_prompt}, greedy(truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt[-63:]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
