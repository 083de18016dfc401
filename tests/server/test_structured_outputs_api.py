"""Structured outputs through a real server with the official `openai` client, on a
random-weight model: OpenAI's response_format, vLLM's structured_outputs and guided_* fields,
streaming and not; every output is checked with jsonschema / re."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

MODEL = "tiny"

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "label": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["book", "pen", "cup"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                  "maxItems": 3},
    },
    "required": ["id", "label", "kind", "sizes"],
}
MESSAGES = [{"role": "user", "content": "Give me an item as JSON."}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "item", "schema": schema,
                                                   "strict": True}}


def test_chat_json_schema(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=schema_format(ITEM), n=3,
        temperature=1.0, seed=11, max_tokens=150)
    assert len(resp.choices) == 3
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ITEM)


def test_chat_json_schema_streaming(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=schema_format(ITEM), n=2,
        temperature=1.0, seed=12, max_tokens=150, stream=True)
    texts, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), ITEM)


def test_completions_response_format_and_vllm_spellings(client):
    resp = client.completions.create(
        model=MODEL, prompt="Item:", max_tokens=150, temperature=1.0, seed=3,
        extra_body={"response_format": schema_format(ITEM)})
    jsonschema.validate(json.loads(resp.choices[0].text), ITEM)
    resp = client.completions.create(
        model=MODEL, prompt="Item:", max_tokens=150, temperature=1.0, seed=4, n=2,
        extra_body={"structured_outputs": {"json": ITEM}})
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.text), ITEM)
    resp = client.completions.create(
        model=MODEL, prompt="Item:", max_tokens=150, temperature=1.0, seed=5,
        extra_body={"guided_json": json.dumps(ITEM)})
    jsonschema.validate(json.loads(resp.choices[0].text), ITEM)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_grammar(client, stream):
    cases = [
        ({"structured_outputs": {"regex": r"[A-Z]{2}\d{3}"}}, r"[A-Z]{2}\d{3}"),
        ({"guided_regex": r"(yes|no)!"}, r"(yes|no)!"),
        ({"structured_outputs": {"choice": ["red", "green", "blue sky"]}}, r"red|green|blue sky"),
        ({"guided_choice": ["up", "down"]}, r"up|down"),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]? "y"'}}, r"x[0-9]{1,2}y"),
        ({"guided_grammar": 'root ::= ("ab" | "cd") ("ab" | "cd")? "."'}, r"(ab|cd){1,2}\."),
    ]
    for extra, pattern in cases:
        resp = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40,
                                         temperature=1.0, seed=9, n=2, stream=stream,
                                         extra_body=extra)
        if stream:
            texts = {}
            for chunk in resp:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
            outputs = list(texts.values())
        else:
            outputs = [c.text for c in resp.choices]
        assert len(outputs) == 2
        for text in outputs:
            assert re.fullmatch(pattern, text), (extra, text)


def test_json_object(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, n=4,
        temperature=1.0, seed=1, max_tokens=100)
    done = [c.message.content for c in resp.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)
    # type text is no constraint at all: same as leaving it out.
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                           max_tokens=5, extra_body={"ignore_eos": True})
    text = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          max_tokens=5, response_format={"type": "text"},
                                          extra_body={"ignore_eos": True})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["x"]}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_grammar": "root ::= nowhere"}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "structured_outputs"),
])
def test_bad_constraints_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body


@pytest.mark.parametrize("extra, limit", [
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(1025)]}}, "max_choices"),
    ({"guided_choice": ["x" * 40000, "y" * 40000]}, "max_grammar_chars"),
    ({"structured_outputs": {"regex": "a" * 20000}}, "max_pattern_chars"),
    ({"structured_outputs": {"grammar": 'root ::= "' + "a" * 70000 + '"'}},
     "max_grammar_chars"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}}},
     "max_schema_chars"),
])
def test_constraints_beyond_the_limits_are_400_naming_the_limit(client, extra, limit):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body=extra)
    assert f"structured_outputs_{limit}" in info.value.body["message"], info.value.body


@pytest.mark.parametrize("extra, says", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "parenthesis"),
    ({"guided_grammar": "root ::= nowhere"}, "not defined"),
    ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "unsatisfiable"),
])
def test_constraint_errors_are_clear_and_carry_no_build_paths(client, extra, says):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       extra_body=extra)
    message = info.value.body["message"]
    assert says in message and "/project" not in message and ".cc:" not in message, message
