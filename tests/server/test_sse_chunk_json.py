"""Streamed chunks written by pydantic's serializer in one pass (`sse_model_event`) are the same
bytes as the dict-then-`json.dumps` path (`sse_event`), for completions and chat chunks, every
kind of text included; chunks holding floats (logprobs) keep the `json.dumps` path."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedkv.http.protocol import (
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from pagedkv.http.sse import sse_event, sse_model_event
from pagedkv.server.serving_chat import _chunk, _without_none
from pagedkv.server.serving_completion import _chunk_event, _chunk_json

TEXTS = ["", " hello", 'quote " backslash \\ slash /', "tab\t nl\n cr\r nul\x00 \x1f",
         "DEL \x7f after", "h\u00e9llo \u2028\u2029 \ufeff", "emoji \U0001f600 \U0010ffff",
         "lone \ud800 surrogate", "".join(chr(i) for i in range(0x20, 0x800))]
USAGE = UsageInfo(prompt_tokens=7, completion_tokens=3, total_tokens=10,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=4))


def _old_chat(chunk: ChatCompletionChunk, usage: UsageInfo | None) -> str:
    """The chat chunk's reference: the dict, unset delta fields dropped, then json.dumps."""
    payload = chunk.model_dump(mode="json", exclude={"usage"} if usage is None else None)
    for item in payload["choices"]:
        item["delta"] = _without_none(item["delta"])
    return sse_event(payload)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("usage", [None, USAGE])
def test_completion_chunk_bytes_equal_the_json_dumps_path(text: str, usage: UsageInfo | None):
    for finish, token_ids in ((None, None), ("length", [1, 2, 3]), ("stop", [])):
        chunk = CompletionResponse(
            id="cmpl-1", model="m", system_fingerprint="fp", usage=usage,
            choices=[CompletionChoice(index=2, text=text, finish_reason=finish,
                                      stop_reason=None if finish != "stop" else "END",
                                      token_ids=token_ids, prompt_token_ids=token_ids)])
        assert _chunk_event(chunk) == sse_event(_chunk_json(chunk))


def test_completion_chunk_with_logprobs_keeps_the_json_dumps_path():
    logprobs = CompletionLogprobs(text_offset=[0], token_logprobs=[-1.5e-05], tokens=["a"],
                                  top_logprobs=[{"a": -1.5e-05}])
    chunk = CompletionResponse(id="c", model="m", choices=[
        CompletionChoice(index=0, text="a", logprobs=logprobs)])
    event = _chunk_event(chunk)
    assert event == sse_event(_chunk_json(chunk)) and "-1.5e-05" in event  # Python's digits
    chunk.choices[0].logprobs.token_logprobs = [float("nan")]
    with pytest.raises(ValueError):  # never invalid JSON
        _chunk_event(chunk)


@pytest.mark.parametrize("text", TEXTS)
def test_chat_chunk_bytes_equal_the_json_dumps_path(text: str):
    serving = SimpleNamespace(model_name="m")
    for role, prompt_ids in ((False, None), (True, [5, 6])):
        extras = SimpleNamespace(id="chatcmpl-1", fingerprint="fp", prompt_text=text,
                                 prompt_ids=lambda ids=prompt_ids: ids)
        for delta in (ChatDelta(content=text), ChatDelta(role="assistant", content=text),
                      ChatDelta(role="assistant"), ChatDelta()):
            for usage in (None, USAGE):
                choice = ChatStreamChoice(index=1, delta=delta, finish_reason="stop",
                                          token_ids=[9])
                event = _chunk(serving, extras, choice, role=role, usage=usage)
                chunk = ChatCompletionChunk(
                    id="chatcmpl-1", model="m", choices=[choice], system_fingerprint="fp",
                    usage=usage, prompt_token_ids=prompt_ids if role else None,
                    prompt_text=text if role else None)
                created = json.loads(event.removeprefix("data: "))["created"]
                chunk.created = created
                assert event == _old_chat(chunk, usage)


def test_chat_chunk_with_logprobs_keeps_the_json_dumps_path():
    choice = ChatStreamChoice(index=0, delta=ChatDelta(content="a"), logprobs=ChatLogprobs(
        content=[ChatTokenLogprob(token="a", logprob=-2.5e-05, top_logprobs=[])]))
    extras = SimpleNamespace(id="c", fingerprint=None, prompt_text=None, prompt_ids=lambda: None)
    event = _chunk(SimpleNamespace(model_name="m"), extras, choice)
    assert "-2.5e-05" in event  # json.dumps' digits (pydantic would write -0.000025)
    assert json.loads(event.removeprefix("data: "))["choices"][0]["delta"] == {"content": "a"}


def test_sse_model_event_falls_back_where_pydantic_writes_otherwise():
    for text in ("DEL \x7f", "lone \udc00"):
        model = CompletionChoice(index=0, text=text)
        assert sse_model_event(model) == sse_event(model.model_dump(mode="json"))
    assert sse_model_event(CompletionChoice(index=0, text="\x7f")).count("\\u007f") == 1
