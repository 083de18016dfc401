"""vLLM's extra routes (/tokenize, /detokenize, /ping, /v1/models/{id}) and its metric names,
on a real server; `pagedkv bench serve`'s scrape reads either prefix."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pagedkv.bench.serve_client import scrape_prefix_cache
from pagedkv.model.tokenizer import Tokenizer
from tests.server.helpers import wait_for_idle_pool

MODEL = "tiny"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama)


def test_tokenize_detokenize(server, tokenizer):
    text = "Hello, paged world"
    resp = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                      "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    bare = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert bare.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": bare.json()["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == text
    # Chat: the same ids the chat endpoint feeds the model (its usage counts them).
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert chat.status_code == 200, chat.text
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert chat.json()["tokens"] == expected
    usage = httpx.post(server.url + "/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat.json()["count"]
    for path, body, param in [("/detokenize", {"tokens": [10**6]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                              ("/tokenize", {"prompt": 5}, None)]:
        resp = httpx.post(server.url + path, json=body)
        assert resp.status_code in (400, 404), resp.text
        if param:
            assert resp.json()["error"]["param"] == param


def test_ping_and_model_card(server):
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def _samples(text: str, prefix: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def test_metrics_under_vllm_names(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    before = _samples(httpx.get(server.url + "/metrics").text, "vllm:")
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="Count the tokens", max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    wait_for_idle_pool(server.url)
    text = httpx.get(server.url + "/metrics").text
    after = _samples(text, "vllm:")
    ours = _samples(text, "pagedkv:")

    def metric(samples, name):
        return next(v for k, v in samples.items() if k.split("{")[0] == name)

    def delta(name):
        return metric(after, name) - metric(before, name)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "generation_tokens_total", "prompt_tokens_total"):
        assert metric(after, f"vllm:{name}") == metric(ours, f"pagedkv:{name}"), name
    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:request_generation_tokens_sum") == 8
    assert delta("vllm:request_generation_tokens_count") == 2
    assert delta("vllm:request_prompt_tokens_count") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 6  # 3 gaps per request
    assert delta("vllm:request_queue_time_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    success = sum(v for k, v in after.items()
                  if k.startswith("vllm:request_success_total") and 'finished_reason="length"' in k)
    assert success >= 2
    assert "vllm:kv_cache_usage_perc" in text and "vllm:num_requests_running" in text


def test_bench_scrape_reads_either_prefix():
    def transport(text):
        return httpx.MockTransport(lambda request: httpx.Response(200, text=text))

    async def scrape(text):
        async with httpx.AsyncClient(transport=transport(text), base_url="http://x") as c:
            return await scrape_prefix_cache(c)
    vllm_only = ('vllm:prefix_cache_hits_total{model_name="m"} 30.0\n'
                 'vllm:prefix_cache_queries_total{model_name="m"} 100.0\n')
    both = vllm_only + ('pagedkv:prefix_cache_hits_total{model_name="m"} 30.0\n'
                        'pagedkv:prefix_cache_queries_total{model_name="m"} 100.0\n')
    assert asyncio.run(scrape(vllm_only)) == (30.0, 100.0)
    assert asyncio.run(scrape(both)) == (30.0, 100.0)  # not counted twice
    assert asyncio.run(scrape("other 1\n")) is None
