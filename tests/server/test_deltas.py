"""Streaming pieces that need no engine: deltas with stop-string hold-back, logprobs formats,
and the SSE response's cleanup."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from pagedkv.engine.outputs import CompletionOutput
from pagedkv.http.sse import SSEResponse, sse_done, sse_event
from pagedkv.server.deltas import FLOOR, DeltaTracker, LogprobsFormatter


def out(text: str, ids: list[int], finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=ids, finish_reason=finish)


def test_text_that_may_start_a_stop_string_is_held_back():
    tracker = DeltaTracker(1, stop=["XYZ"], include_stop_str=False)
    assert tracker.delta(0, out("ab", [1])).text == ""  # 2 chars held back (len("XYZ") - 1)
    assert tracker.delta(0, out("abcX", [1, 2])).text == "ab"
    delta = tracker.delta(0, out("abc", [1, 2, 3], finish="stop"))  # engine cut "XYZ" off
    assert (delta.text, delta.finish_reason) == ("c", "stop")
    assert (delta.token_start, delta.token_end) == (2, 3)
    assert tracker.delta(0, out("abc", [1, 2, 3], finish="stop")) is None  # finish sent once
    assert tracker.all_finished


def test_no_hold_back_without_stop_strings_and_no_empty_deltas():
    tracker = DeltaTracker(2, stop=[], include_stop_str=False)
    assert tracker.delta(1, out("hé", [5, 6])).text == "hé"
    assert tracker.delta(1, out("hé", [5, 6])) is None
    assert tracker.delta(1, out("hé", [5, 6, 7])).text == ""  # a token still waiting for bytes
    assert not tracker.all_finished


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_logprobs_formats():
    comp = CompletionOutput(index=0, text="bc", token_ids=[1, 2], logprobs=[
        {1: -0.1, 0: -2.0, 3: -3.0}, {2: -5.0, 0: float("-inf"), 3: -1.0}])
    fmt = LogprobsFormatter(_Tokenizer(), top_n=2)
    legacy = fmt.completion(comp, 0, 2)
    assert legacy.tokens == ["b", "c"] and legacy.token_logprobs == [-0.1, -5.0]
    assert legacy.text_offset == [0, 1]
    assert legacy.top_logprobs == [{"b": -0.1, "a": -2.0}, {"d": -1.0, "c": -5.0}]
    chat = fmt.chat(comp, 1, 2).content
    assert [(t.token, t.logprob) for t in chat] == [("c", -5.0)]
    assert [(t.token, t.logprob) for t in chat[0].top_logprobs] == [("d", -1.0), ("c", -5.0)]
    ids = LogprobsFormatter(_Tokenizer(), top_n=3, as_token_ids=True).chat(comp, 1, 2).content
    assert ids[0].token == "token_id:2" and ids[0].top_logprobs[-1].logprob == FLOOR
    assert fmt.completion(CompletionOutput(index=0), 0, 0) is None


def test_sse_framing_and_cleanup_when_the_client_is_gone_before_the_first_event():
    assert sse_event({"a": 1}) == 'data: {"a":1}\n\n' and sse_done() == "data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse_event({"x": float("nan")})
    closed: list[int] = []

    async def body():
        yield sse_done()

    async def send(_: dict) -> None:
        raise OSError("connection reset")

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    response = SSEResponse(body(), on_close=lambda: closed.append(1))
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        asyncio.run(response(scope, receive, send))
    assert closed == [1]
