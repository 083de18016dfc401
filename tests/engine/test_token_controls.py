"""logit_bias, allowed_token_ids, bad_words and truncate_prompt_tokens through the engine."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.sched.apply import bad_word_bans
from pagedkv.sched.request import Request
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


def test_list_fields_are_capped_and_ids_checked_offline(tiny_llama, make_llm):
    from pagedkv.sched.validation import (
        MAX_ALLOWED_TOKEN_IDS,
        MAX_BAD_WORDS,
        MAX_LOGIT_BIAS,
        MAX_STOP_STRINGS,
        MAX_STOP_TOKEN_IDS,
        MAX_TEXT_LIST_BYTES,
    )

    too_many = {"bad_words": ([f"w{i}" for i in range(20_000)], MAX_BAD_WORDS),
                "stop": (["s"] * (MAX_STOP_STRINGS + 1), MAX_STOP_STRINGS),
                "stop_token_ids": ([1] * (MAX_STOP_TOKEN_IDS + 1), MAX_STOP_TOKEN_IDS),
                "logit_bias": ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, MAX_LOGIT_BIAS),
                "allowed_token_ids": ([5] * (MAX_ALLOWED_TOKEN_IDS + 1), MAX_ALLOWED_TOKEN_IDS)}
    for name, (value, limit) in too_many.items():
        with pytest.raises(ValueError, match=rf"^{name} .*limit of {limit}$"):
            SamplingParams(**{name: value})
    with pytest.raises(ValueError, match=str(MAX_TEXT_LIST_BYTES)):
        SamplingParams(bad_words=["x" * (MAX_TEXT_LIST_BYTES + 1)])
    assert SamplingParams(allowed_token_ids=[9, 5] * 100_000 + [3]).allowed_token_ids == [3, 5, 9]
    llm = make_llm(tiny_llama, dtype="float32")
    vocab = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids .*: {vocab}, {vocab + 2}$"):
        llm.generate("x", SamplingParams(stop_token_ids=[1, vocab + 2, vocab]), use_tqdm=False)
    # Bad words: each distinct token sequence once (a set, not a list scan).
    engine = llm.llm_engine
    assert engine.bad_words_token_ids(["a b", "a b", " a b"]) == engine.bad_words_token_ids(["a b"])
