"""A complete grammar finishes its request whatever `ignore_eos` and `min_tokens` say, and a
grammar-engine failure ends only its own request: the unconstrained requests batched with it
go on and produce transformers' greedy tokens."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams, StructuredOutputsParams
from pagedkv.config.errors import ErrorKind
from tests.engine.conftest import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23]]
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from pagedkv import LLM
    return LLM(str(tiny_llama), dtype="float32", seed=0, block_size=4,
               num_gpu_blocks_override=200)


def _run(llm, grammar_params: SamplingParams, before_first_step=None):
    """One constrained request batched with two greedy ones; (constrained output, the two
    greedy token lists). `before_first_step(request)` may tamper with the queued request."""
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"plain-{i}", {"prompt_token_ids": prompt}, greedy)
    engine.add_request("constrained", {"prompt_token_ids": [30, 31, 32]}, grammar_params)
    if before_first_step is not None:
        before_first_step(engine.scheduler.requests["constrained"])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    engine.check_invariants()
    return finals["constrained"], [list(finals[f"plain-{i}"].outputs[0].token_ids)
                                   for i in range(2)]


def _check_others(tiny_llama, plain):
    for prompt, tokens in zip(PROMPTS, plain, strict=True):
        assert tokens == hf_greedy(tiny_llama, prompt, 8)


@pytest.mark.parametrize("extra", [dict(ignore_eos=True), dict(ignore_eos=True, min_tokens=6),
                                   dict(min_tokens=6), dict(bad_words=["</s>"])])
def test_a_complete_grammar_finishes_its_request(llm, tiny_llama, extra):
    so = StructuredOutputsParams(choice=CHOICES)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs=so,
                            **extra)
    final, plain = _run(llm, params)
    out = final.outputs[0]
    assert out.finish_reason == "stop" and out.text in CHOICES, final
    _check_others(tiny_llama, plain)


def test_a_grammar_terminated_before_its_step_ends_only_its_request(llm, tiny_llama):
    """The state the issue reached: a request still running whose grammar has already accepted
    its stop token (the grammar engine raises when asked for its next mask)."""
    tokenizer = llm.llm_engine.tokenizer
    eos = llm.llm_engine.eos_token_ids[0]

    def terminate(request):
        grammar = request.structured_output
        for token in tokenizer.encode("yes", add_special_tokens=False) + [eos]:
            assert grammar.accept_token(token)
        assert grammar.is_terminated()

    so = StructuredOutputsParams(choice=CHOICES)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                            structured_outputs=so)
    final, plain = _run(llm, params, terminate)
    assert final.outputs[0].finish_reason == "stop" and list(final.outputs[0].token_ids) == []
    _check_others(tiny_llama, plain)


class _BrokenMatcher:
    """A grammar engine that fails the way xgrammar does: an error carrying its build path."""

    def __init__(self, inner):
        self.inner = inner

    def fill_next_token_bitmask(self, bitmask, row):
        raise RuntimeError("[09:03:14] /project/cpp/grammar_matcher.cc:1687: Check failed: "
                           "(!IsStopTokenAccepted()) is false: internal state lost")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_grammar_error_ends_only_its_own_request(llm, tiny_llama):
    def break_it(request):
        grammar = request.structured_output
        grammar._matcher = _BrokenMatcher(grammar._matcher)

    so = StructuredOutputsParams(regex="[a-z]+")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                            structured_outputs=so)
    final, plain = _run(llm, params, break_it)
    assert final.outputs[0].finish_reason == "error"
    assert "internal state lost" in final.error
    assert final.error_kind is ErrorKind.INVALID  # the request's own grammar: a 400
    assert ".cc" not in final.error and "Check failed" not in final.error
    _check_others(tiny_llama, plain)
