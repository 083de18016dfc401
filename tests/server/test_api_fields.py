"""The request fields real clients send: explicit nulls, integral floats, unknown fields,
logit_bias / allowed_token_ids / bad_words / truncate_prompt_tokens, max_completion_tokens,
chat_template_kwargs and continue_final_message; and the chat stream's first chunk waiting for
the prompt to be processed."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.http.prompt_render import render_chat
from pagedkv.http.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.response_extras import ResponseExtras
from pagedkv.server.serving_chat import _stream
from pagedkv.server.tools import ToolChoice

MODEL = "tiny"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_explicit_nulls_are_defaults(server):
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "presence_penalty",
                               "frequency_penalty", "logprobs", "seed", "stop", "user",
                               "stream_options", "max_completion_tokens", "logit_bias")}
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                            "ignore_eos": True, **nulls})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    chat = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": None}],
        "max_tokens": 2, "ignore_eos": True, "tools": None, "tool_choice": None,
        "response_format": None, "top_logprobs": None, **nulls})
    assert chat.status_code == 200, chat.text


def test_integral_floats_are_ints(server):
    resp = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2.0, "n": 2.0,
                                            "ignore_eos": True, "logprobs": 1.0, "seed": 3.0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 4
    for bad in ({"max_tokens": 2.5}, {"n": 1.5}, {"max_tokens": "2"}):
        resp = post(server, "/v1/completions", {"prompt": "Hi", **bad})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == next(iter(bad))


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "frobnicate": 1, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "x", "guided_decoding_backend": "outlines", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "audio": {"voice": "a"}, "max_tokens": 1}),
])
def test_unknown_top_level_fields_are_ignored(server, path, body):
    """vLLM's rule (proxies add their own fields); tests/server/test_vllm_request_fields.py
    checks the warning and --strict-request-fields."""
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text


def test_unknown_nested_field_is_400_naming_its_parent(server):
    resp = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "structured_outputs": {"jsn": {}}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "structured_outputs" and "jsn" in error["message"]


def test_logit_bias_allowed_tokens_and_max_completion_tokens(client):
    resp = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                     logit_bias={"42": 100}, logprobs=0,
                                     extra_body={"ignore_eos": True,
                                                 "return_tokens_as_token_ids": True})
    assert resp.choices[0].logprobs.tokens == ["token_id:42"] * 4
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=5,
        temperature=1.0, seed=2, logprobs=True,
        extra_body={"allowed_token_ids": [30, 31], "ignore_eos": True,
                    "return_tokens_as_token_ids": True})
    tokens = [t.token for t in resp.choices[0].logprobs.content]
    assert len(tokens) == 5 and set(tokens) <= {"token_id:30", "token_id:31"}
    resp = client.completions.create(model=MODEL, prompt="Hi", temperature=0,
                                     extra_body={"max_completion_tokens": 3, "ignore_eos": True})
    assert resp.usage.completion_tokens == 3
    for bad in ({"logit_bias": {"abc": 1}}, {"logit_bias": {"5": 101}},
                {"allowed_token_ids": [10**6]}, {"allowed_token_ids": []}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=bad)


def test_truncate_prompt_tokens_and_bad_words(client):
    ids = [3 + i % 600 for i in range(2000)]  # longer than max_model_len (1024)
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 10,
                                                 "ignore_eos": True})
    assert resp.usage.prompt_tokens == 10
    plain = client.completions.create(model=MODEL, prompt=ids[-10:], max_tokens=2,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == plain.choices[0].text
    # logit_bias forces token 42 ("D"); bad_words "D" forbids it again.
    forced = dict(ignore_eos=True, return_tokens_as_token_ids=True, logit_bias={"42": 100})
    resp = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=3, temperature=0,
                                     logprobs=0, extra_body=forced)
    assert resp.choices[0].logprobs.tokens == ["token_id:42"] * 3
    resp = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=3, temperature=0,
                                     logprobs=0, extra_body={**forced, "bad_words": ["D"]})
    assert "token_id:42" not in resp.choices[0].logprobs.tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    tok = Tokenizer.from_dir(tiny_llama)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if enable_thinking %}<think>{% endif %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    return tok


class _Serving:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.model_name = MODEL


def test_chat_template_kwargs_and_continue_final_message(tokenizer):
    serving = _Serving(tokenizer)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    req = ChatCompletionRequest(messages=messages[:1], chat_template_kwargs={"enable_thinking": True})
    assert render_chat(serving, req).endswith("<think><|assistant|>\n")
    req = ChatCompletionRequest(messages=messages, add_generation_prompt=False,
                                continue_final_message=True)
    assert render_chat(serving, req).endswith("<|assistant|>\nWell,")
    from pagedkv.http.errors import APIError
    with pytest.raises(APIError, match="add_generation_prompt"):
        render_chat(serving, ChatCompletionRequest(messages=messages,
                                                     continue_final_message=True))
    with pytest.raises(APIError, match="messages"):
        render_chat(serving, ChatCompletionRequest(messages=messages[:1],
                                                     chat_template_kwargs={"messages": []}))
    # The completion request model accepts the same leniencies.
    assert CompletionRequest(prompt="x", max_tokens=3.0).max_tokens == 3


def test_chat_stream_sends_nothing_before_the_first_output(tokenizer):
    """The role chunk waits for the engine's first output (the prompt processed), as vLLM."""
    first_output = asyncio.Event()

    class Serving(_Serving):
        async def iterate(self, streams):
            await first_output.wait()
            yield 0, RequestOutput("r", "p", [1], [CompletionOutput(0, "a", [5])])
            yield 0, RequestOutput("r", "p", [1], [CompletionOutput(
                0, "ab", [5, 6], finish_reason="length")], finished=True)

    from pagedkv import SamplingParams
    from pagedkv.server.deltas import LogprobsFormatter

    async def run() -> list[str]:
        params = SamplingParams(max_tokens=2)
        extras = ResponseExtras("id", None, None, detokenize=True)
        gen = _stream(Serving(tokenizer), extras, [], params, LogprobsFormatter(tokenizer, 0),
                      (False, False), ToolChoice("none"))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done()  # nothing, not even the role, before the prompt is processed
        first_output.set()
        chunks = [await first]
        chunks += [c async for c in gen]
        return chunks

    chunks = asyncio.run(run())
    assert '"role":"assistant"' in chunks[0].replace(" ", "")
    assert '"content":"a"' in chunks[1].replace(" ", "")
