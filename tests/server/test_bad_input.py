"""Every kind of bad input gets a 4xx with an OpenAI-style error body: never a 500, a hang or
a held block (checked through /metrics after the lot)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.helpers import ENGINE_KWARGS, wait_for_idle_pool

MODEL = "tiny"
TOO_LONG = [11] * (ENGINE_KWARGS["max_model_len"] + 1)

BAD_COMPLETIONS: list[tuple[str, object, int, str | None]] = [
    # (case, JSON body (a str is sent raw), status, offending param)
    ("malformed json", '{"model": "tiny", "prompt": "x"', 400, None),
    ("not an object", "[1, 2, 3]", 400, None),
    ("empty body", "", 400, None),
    ("missing prompt", {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", {"prompt": 5}, 400, "prompt"),
    ("prompt list of mixed", {"prompt": [1, "a"]}, 400, "prompt"),
    ("empty token list", {"prompt": []}, 400, "prompt"),
    ("negative token id", {"prompt": [1, -3]}, 400, "prompt"),
    ("token id out of vocab", {"prompt": [1, 10**6]}, 400, None),
    ("max_tokens string", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens float", {"prompt": "x", "max_tokens": 5.5}, 400, "max_tokens"),
    ("max_tokens zero", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens absurd", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("max_tokens beyond int64", {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ("n zero", {"prompt": "x", "n": 0}, 400, "n"),
    ("n absurd", {"prompt": "x", "n": 10**9}, 400, "n"),
    ("n bool", {"prompt": "x", "n": True}, 400, "n"),
    # param null, as vLLM's (test_vllm_request_fields.py::test_error_param_as_vllms checks it)
    ("n > 1 greedy", {"prompt": "x", "n": 2, "temperature": 0.0}, 400, None),
    ("n > 1 near-greedy", {"prompt": "x", "n": 3, "temperature": 1e-6}, 400, None),
    ("temperature negative", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("temperature absurd", {"prompt": "x", "temperature": 1e30}, 400, "temperature"),
    ("temperature string", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above one", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("min_p above one", {"prompt": "x", "min_p": 2.0}, 400, "min_p"),
    ("presence_penalty", {"prompt": "x", "presence_penalty": 3.0}, 400, "presence_penalty"),
    ("frequency_penalty", {"prompt": "x", "frequency_penalty": -9}, 400, "frequency_penalty"),
    ("repetition_penalty zero", {"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("logprobs absurd", {"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    ("logprobs negative", {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("seed beyond int64", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("seed string", {"prompt": "x", "seed": "42"}, 400, "seed"),
    ("stop wrong type", {"prompt": "x", "stop": 7}, 400, "stop"),
    ("stop empty string", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("min_tokens above max_tokens", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, None),
    ("stream not bool", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("prompt_logprobs absurd", {"prompt": "x", "echo": True, "prompt_logprobs": 21}, 400,
     "prompt_logprobs"),
    ("best_of above n", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("cache_salt empty", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ("prompt too long", {"prompt": TOO_LONG}, 400, "prompt"),
    ("prompt plus max_tokens too long",
     {"prompt": [11] * 1000, "max_tokens": ENGINE_KWARGS["max_model_len"]}, 400, "max_tokens"),
    ("unknown model", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
]

BAD_CHAT: list[tuple[str, object, int, str | None]] = [
    ("no messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("n > 1 greedy", {"messages": [{"role": "user", "content": "x"}], "n": 2,
                      "temperature": 0}, 400, None),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("top_logprobs without logprobs",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs absurd", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                             "top_logprobs": 10**6}, 400, "top_logprobs"),
    ("max_completion_tokens absurd", {"messages": [{"role": "user", "content": "x"}],
                                      "max_completion_tokens": 10**9}, 400, "max_tokens"),
    ("unknown model", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404,
     "model"),
]


def post(url: str, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content, timeout=30,
                      headers={"content-type": "application/json"})


def check_error(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("case,body,status,param", BAD_COMPLETIONS,
                         ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_request(server, case, body, status, param):
    check_error(post(server.url, "/v1/completions", body), status, param)


@pytest.mark.parametrize("case,body,status,param", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_request(server, case, body, status, param):
    check_error(post(server.url, "/v1/chat/completions", body), status, param)


def test_unknown_route_and_method(server):
    check_error(httpx.get(server.url + "/v1/nothing-here"), 404, None)
    check_error(httpx.get(server.url + "/v1/completions"), 405, None)


def test_streaming_bad_input_is_a_4xx_before_any_event(server):
    resp = post(server.url, "/v1/completions", {"prompt": TOO_LONG, "stream": True})
    check_error(resp, 400, "prompt")


def test_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=TOO_LONG, max_tokens=2)
    assert "maximum context length" in str(info.value)


def test_no_block_held_after_bad_requests(server):
    for _, body, _, _ in BAD_COMPLETIONS[:12]:
        post(server.url, "/v1/completions", body)
    metrics = wait_for_idle_pool(server.url)
    assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0
    assert metrics["pagedkv:num_requests_waiting"] == 0
    assert httpx.get(server.url + "/health").status_code == 200
