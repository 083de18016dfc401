"""Structured outputs through the engine on a random-weight model: every output satisfies its
constraint (checked with jsonschema / re), the request stops when the grammar terminates, the
compiled grammar is cached, and unconstrained requests in the same batch are unaffected."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedkv import SamplingParams, StructuredOutputsParams
from tests.engine.conftest import hf_greedy

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from pagedkv import LLM
    return LLM(str(tiny_llama), dtype="float32", seed=0, block_size=4,
               max_num_batched_tokens=16, num_gpu_blocks_override=200)


def sample(llm, prompts, so, n=2, max_tokens=120, **kw):
    params = SamplingParams(temperature=1.0, seed=7, n=n, max_tokens=max_tokens,
                            structured_outputs=so, **kw)
    return llm.generate(prompts, params, use_tqdm=False)


def texts(outputs):
    for out in outputs:
        for comp in out.outputs:
            assert comp.finish_reason == "stop", comp
            yield comp.text


def test_json_schema_outputs_validate(llm):
    outputs = sample(llm, ["Hello", "Describe a person", "x" * 30],
                     StructuredOutputsParams(json=PERSON))
    for text in texts(outputs):
        jsonschema.validate(json.loads(text), PERSON)
    llm.llm_engine.check_invariants()


def test_json_schema_as_string_and_greedy(llm):
    so = StructuredOutputsParams(json=json.dumps(PERSON))
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)
    for text in texts(llm.generate(["Hello", "Bye"], params, use_tqdm=False)):
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_choice_grammar_json_object(llm):
    for text in texts(sample(llm, ["a", "b"], StructuredOutputsParams(regex=r"[a-z]{3}-\d{2}"))):
        assert re.fullmatch(r"[a-z]{3}-\d{2}", text), text
    choices = ["yes", "no", "maybe so"]
    for text in texts(sample(llm, ["a", "b"], StructuredOutputsParams(choice=choices), n=4)):
        assert text in choices
    grammar = 'root ::= "A" ("b" | "c")+ "!"'
    for text in texts(sample(llm, ["a"], StructuredOutputsParams(grammar=grammar))):
        assert re.fullmatch(r"A[bc]+!", text), text
    lark = 'start: "X" DIGIT DIGIT\n%import common.DIGIT'
    for text in texts(sample(llm, ["a"], StructuredOutputsParams(grammar=lark))):
        assert re.fullmatch(r"X\d\d", text), text
    # Any object: keys and values are unbounded, so a random model may run out of tokens;
    # every output that finished is an object.
    finished = [c.text for o in sample(llm, ["a", "b"], StructuredOutputsParams(json_object=True))
                for c in o.outputs if c.finish_reason == "stop"]
    assert finished
    assert all(isinstance(json.loads(text), dict) for text in finished)


def test_compiled_once_per_constraint(tiny_llama):
    from pagedkv import LLM
    llm = LLM(str(tiny_llama), dtype="float32", seed=0)
    backend = llm.llm_engine.structured_output_backend
    so = StructuredOutputsParams(json=PERSON)
    for _ in range(3):
        sample(llm, ["Hello", "Bye"], so, n=1)
    sample(llm, ["Hello"], StructuredOutputsParams(json=json.dumps(PERSON)), n=1)  # same key
    assert backend.num_compilations == 1
    sample(llm, ["Hello"], StructuredOutputsParams(regex="[0-9]+"), n=1, max_tokens=5)
    assert backend.num_compilations == 2


def test_unconstrained_requests_in_the_same_batch_are_unaffected(llm, tiny_llama):
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(json=PERSON))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 2,
                           [greedy, greedy, constrained, constrained], use_tqdm=False)
    for prompt, out in zip(prompts, outputs[:2], strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, 8)
    for out in outputs[2:]:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_bad_constraints_are_value_errors(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="json"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": PERSON})
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="(unclosed")), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        llm.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(
            grammar="root ::= undefined_rule")), use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert not llm.llm_engine.has_unfinished_requests()
