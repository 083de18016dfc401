"""Tool calling through a real server with the official `openai` client, on a random-weight
model: `required` and a named function are enforced by structured outputs (arguments checked
with jsonschema, streaming and not); `auto` needs --tool-call-parser; the template sees the
tools; the parsers split Hermes and Llama 3 JSON outputs."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from pagedkv.server.tool_parsers import get_tool_parser
from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}},
        "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A template that renders the tools, so that the test can see they reach it.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n{{ tools | tojson }}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['tool_calls'] %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "{{ message['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_server(tiny_llama, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tools_model") / "m"
    shutil.copytree(tiny_llama, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    proc = ServerProcess(model_dir, *engine_flags(**ENGINE_KWARGS), "--tool-call-parser",
                         "hermes").start()
    try:
        yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0,
                            timeout=120)
    finally:
        assert proc.stop()


def check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, n=2, temperature=1.0, seed=2,
        max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_weather"})


def test_required(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, n=3, temperature=1.0, seed=3,
        max_tokens=120, tool_choice="required", parallel_tool_calls=False)
    names = set()
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)
        names.add(choice.message.tool_calls[0].function.name)
    assert names <= set(SCHEMAS)


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_streaming_tool_calls(client, tool_choice):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=4, max_tokens=120,
        tool_choice=tool_choice, parallel_tool_calls=False, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    first = True
    for chunk in stream:
        for choice in chunk.choices:
            if first:  # the role comes first, alone
                assert choice.delta.role == "assistant"
                first = False
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or piece.id
                call["name"] = call["name"] or piece.function.name
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    assert list(calls) == [0]
    call = calls[0]
    assert call["id"].startswith("chatcmpl-tool-")
    if tool_choice != "required":
        assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_errors_and_none(client):
    with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       max_tokens=5, tool_choice={"type": "function",
                                                                  "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       max_tokens=5, tool_choice="required",
                                       response_format={"type": "json_object"})
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                          tool_choice="none", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.tool_calls in (None, [])
    assert resp.choices[0].finish_reason == "length"


def test_auto_with_hermes_parser_and_tools_in_template(hermes_server):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    resp = hermes_server.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=1.0,
        extra_body={"structured_outputs": {"choice": [call]}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Oslo", "days": 2}
    # The template rendered the tools: the prompt is longer with them than without.
    without = hermes_server.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                    max_tokens=1)
    assert resp.usage.prompt_tokens > without.usage.prompt_tokens + 20
    # Plain text under auto is content; streaming gives the same calls.
    plain = hermes_server.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True})
    assert plain.choices[0].message.tool_calls is None  # omitted when empty, as vLLM does
    assert plain.choices[0].message.content
    chunks = list(hermes_server.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=80, stream=True,
        extra_body={"structured_outputs": {"choice": [call]}}))
    pieces = [p for c in chunks for ch in c.choices for p in (ch.delta.tool_calls or [])]
    assert [p.function.name for p in pieces] == ["get_weather"]
    assert json.loads(pieces[0].function.arguments) == {"city": "Oslo", "days": 2}
    # A multi-turn conversation carrying a tool call and its result renders too.
    history = [*MESSAGES,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    follow = hermes_server.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                                   max_tokens=3, tool_choice="none")
    assert follow.usage.prompt_tokens > resp.usage.prompt_tokens


def test_hermes_parser():
    parser = get_tool_parser("hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    content, calls = parser.extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert parser.extract("no calls here") == ("no calls here", [])
    assert parser.extract("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    content, calls = parser.extract('<tool_call>{"name": "c", "arguments": {"y": "z"}}')
    assert content is None and calls[0].name == "c"


def test_llama3_json_parser():
    parser = get_tool_parser("llama3_json")
    content, calls = parser.extract(
        '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {}}')
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"q": "x"}), ("b", {})]
    assert parser.extract("Hello there") == ("Hello there", [])
    assert parser.extract('{"not": "a call"}') == ('{"not": "a call"}', [])
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
