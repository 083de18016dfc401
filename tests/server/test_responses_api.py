"""POST /v1/responses through the official openai client: text in and out, equal to the chat
completion of the same messages (greedy), streaming events in OpenAI's order."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.server.responses_protocol import ResponsesRequest
from pagedkv.server.serving_responses import _response

GREEDY = {"temperature": 0.0, "max_output_tokens": 8}


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int = 8) -> str:
    resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0,
                                          max_tokens=max_tokens)
    return resp.choices[0].message.content


def test_text_in_text_out_equals_chat(client):
    resp = client.responses.create(model="tiny", input="Tell me a story", **GREEDY)
    assert resp.object == "response" and resp.status == "incomplete"  # cut by the limit
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == chat_text(client, [{"role": "user", "content": "Tell me a story"}])
    assert resp.usage.output_tokens == 8
    assert resp.usage.total_tokens == resp.usage.input_tokens + 8
    assert resp.output[0].role == "assistant" and resp.output[0].content[0].type == "output_text"


def test_instructions_and_message_list(client):
    resp = client.responses.create(
        model="tiny", instructions="Be brief.",
        input=[{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
               {"role": "user", "content": [{"type": "input_text", "text": "Again"}]}],
        **GREEDY)
    expected = chat_text(client, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello"},
                                  {"role": "user", "content": "Again"}])
    assert resp.output_text == expected


def test_streaming_events(client):
    stream = client.responses.create(model="tiny", input="Tell me a story", stream=True,
                                     **GREEDY)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text
    assert text == chat_text(client, [{"role": "user", "content": "Tell me a story"}])
    assert events[-1].response.status == "incomplete"  # cut by the limit, as vLLM reports it


def test_sdk_stream_helper_gets_the_final_response(client):
    """The SDK's `responses.stream()` needs `response.completed`, also for a cut response."""
    with client.responses.stream(model="tiny", input="Tell me a story", **GREEDY) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.output_text == "".join(deltas)
    assert final.usage.output_tokens == 8


def test_status_follows_the_finish_reason():
    """eos or a stop string: completed; the length limit: incomplete (max_output_tokens)."""
    serving = SimpleNamespace(model_name="m", system_fingerprint="fp")
    req = ResponsesRequest(input="x")
    for reason, status in (("stop", "completed"), ("length", "incomplete")):
        final = RequestOutput("r", "x", [1, 2], [CompletionOutput(0, "ab", [5, 6],
                                                                  finish_reason=reason)])
        resp = _response(serving, req, "resp_1", "msg_1", final)
        assert resp.status == status and resp.output[0].status == status
        assert (resp.incomplete_details is None) == (status == "completed")
        assert resp.usage.total_tokens == 4 and resp.output[0].content[0].text == "ab"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": "x", "model": "nope"}, "model"),
])
def test_bad_requests(server, body, param):
    resp = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert resp.status_code == (404 if param in ("model", "previous_response_id") else 400), \
        resp.text
    assert resp.json()["error"]["param"] == param
    assert resp.json()["error"]["code"] == resp.status_code


def test_answer_carries_vllms_response_keys(server):
    """vLLM 0.32's keys of a response object (benchmarks/vs_vllm_api.py diffs them against a
    real vLLM), with what this server does: no background, one tier, no penalties."""
    body = httpx.post(server.url + "/v1/responses", timeout=60,
                      json={"model": "tiny", "input": "Tell me a story", **GREEDY}).json()
    assert body["background"] is False and body["service_tier"] == "auto"
    assert body["presence_penalty"] == body["frequency_penalty"] == 0.0
    for key in ("max_tool_calls", "prompt", "reasoning", "top_logprobs", "kv_transfer_params",
                "ec_transfer_params", "input_messages", "output_messages"):
        assert key in body and body[key] is None, key
    assert "phase" in body["output"][0] and body["output"][0]["phase"] is None
    usage = body["usage"]
    assert usage["output_tokens"] == GREEDY["max_output_tokens"]
    assert usage["input_tokens_details"]["cache_write_tokens"] == 0
    assert usage["input_tokens_details"]["input_tokens_per_turn"] == []
    assert usage["output_tokens_details"]["tool_output_tokens"] == 0
    assert usage["output_tokens_details"]["tool_output_tokens_per_turn"] == []


def test_answer_carries_openais_response_keys(server):
    """OpenAI's Response object: `error` null, `store` false (nothing is stored), `text` with
    its text format and verbosity, `completed_at` once completed, the prompt-cache and safety
    ids echoed; the openai client reads them."""
    body = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "Tell me a story", "store": True, "text": {
            "format": {"type": "text"}, "verbosity": "low"}, "prompt_cache_key": "k-1",
        "safety_identifier": "user-7", **GREEDY}).json()
    assert body["error"] is None and body["store"] is False
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert body["status"] == "incomplete" and body["completed_at"] is None
    assert body["prompt_cache_key"] == "k-1" and body["safety_identifier"] == "user-7"
    assert body["conversation"] is None and body["prompt_cache_retention"] is None
    plain = httpx.post(server.url + "/v1/responses", timeout=60,
                       json={"model": "tiny", "input": "x", **GREEDY}).json()
    assert plain["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert plain["prompt_cache_key"] is None and plain["error"] is None


def test_completed_answers_carry_completed_at():
    serving = SimpleNamespace(model_name="m", system_fingerprint="fp")
    final = RequestOutput("r", "x", [1, 2], [CompletionOutput(0, "ab", [5, 6],
                                                              finish_reason="stop")])
    before = int(time.time())
    resp = _response(serving, ResponsesRequest(input="x"), "resp_1", "msg_1", final)
    assert resp.status == "completed" and before <= resp.completed_at <= int(time.time())
    assert _response(serving, ResponsesRequest(input="x"), "resp_1", "msg_1",
                     None).completed_at is None


def test_truncation_auto_drops_the_input_start(client, server):
    """`truncation: "auto"` (OpenAI's, vLLM accepts it): an input longer than the context is
    cut from its start so the answer fits; "disabled" (the default) is a 400 for it."""
    limit = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    long_input = "word " * (limit + 50)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=long_input, **GREEDY)
    resp = client.responses.create(model="tiny", input=long_input, truncation="auto", **GREEDY)
    assert resp.truncation == "auto" and resp.usage.output_tokens == 8
    assert resp.usage.input_tokens == limit - GREEDY["max_output_tokens"]
