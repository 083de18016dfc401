"""A real `pagedkv serve` process driven by the official `openai` client.

Greedy outputs are checked token for token against the offline `LLM` with the same engine
arguments; aborts and disconnects are checked through /metrics (no request left, no block
held); the server's loop checks the block pool's invariants whenever it falls idle and /health
reports a failure, which the fixture's teardown asserts.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from pagedkv import LLM, SamplingParams
from tests.server.helpers import ENGINE_KWARGS, scrape, wait_for_idle_pool

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    """The offline reference: same model, same engine arguments as the server."""
    return LLM(str(tiny_llama), **ENGINE_KWARGS)


def greedy_ids(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    """Token ids from logprobs written with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == ENGINE_KWARGS["max_model_len"]
    assert card["vocab_size"] > 0
    # vLLM's ModelPermission, one per card, with its fixed values
    [permission] = card["permission"]
    assert permission["id"].startswith("modelperm-") and permission["organization"] == "*"
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True
    assert permission["allow_fine_tuning"] is False and permission["group"] is None
    assert card["parent"] is None
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_matches_offline_greedy(client, offline):
    prompt = "The quick brown fox"
    expected = greedy_ids(offline, [prompt], 12)[0]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = resp.choices[0]
    assert token_ids(choice.logprobs.tokens) == expected
    assert choice.text == offline.get_tokenizer().decode(expected)
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == 12
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == len(offline.get_tokenizer().encode(prompt))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_token_id_prompt_and_prompt_list(client, offline):
    tokenizer = offline.get_tokenizer()
    prompts = ["Hello, world!", "Prefix caching lets requests"]
    expected = greedy_ids(offline, prompts, 6)
    ids = tokenizer.encode(prompts[0])
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == tokenizer.decode(expected[0])
    # n > 1 with greedy sampling is a 400 (vLLM's rule); top_k 1 samples the greedy tokens
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=1.0,
                                     n=2, extra_body={"ignore_eos": True, "top_k": 1})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    texts = [c.text for c in resp.choices]
    assert texts == [tokenizer.decode(expected[0])] * 2 + [tokenizer.decode(expected[1])] * 2
    assert resp.usage.completion_tokens == 24


def test_chat_matches_offline(client, offline):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me a story."}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = offline.chat(messages, params, use_tqdm=False)[0]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert token_ids([t.token for t in choice.logprobs.content]) == expected.outputs[0].token_ids
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streaming_completion_and_chat(client, offline):
    prompt = "Once upon a time"
    expected = offline.get_tokenizer().decode(greedy_ids(offline, [prompt], 10)[0])
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=1.0, stream=True, n=2, extra_body={"ignore_eos": True, "top_k": 1})
    content, finish, roles = {0: "", 1: ""}, {}, set()
    for chunk in stream:
        for choice in chunk.choices:
            roles.add((choice.index, choice.delta.role))
            content[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    expected = offline.chat([{"role": "user", "content": "hi"}],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    assert content == {0: expected, 1: expected}  # top_k 1: both samples are the greedy one
    assert finish == {0: "length", 1: "length"}
    assert {(0, "assistant"), (1, "assistant")} <= roles


def test_raw_sse_format_ends_with_done(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert len({p["id"] for p in payloads}) == 1


def test_n_samples_with_seed_are_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Sampling test", max_tokens=8, temperature=1.0, n=3,
                  seed=1234, extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**kwargs).choices]
    second = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == second
    assert len(first) == 3 and len(set(first)) > 1  # the samples differ from each other
    other = [c.text for c in client.completions.create(**{**kwargs, "seed": 99}).choices]
    assert other != first


def test_stop_string_is_cut_and_never_streamed(client, offline):
    prompt = "Numbers: 0 1 2"
    full = offline.get_tokenizer().decode(greedy_ids(offline, [prompt], 16)[0])
    stop = full[5:7]  # a string the greedy output is known to contain
    assert stop and stop in full
    cut = full[: full.index(stop)]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == cut


def test_cached_tokens_on_repeated_prefix(server, client):
    prefix = "A paged KV cache stores keys and values in fixed-size blocks of tokens. " * 3
    first = client.completions.create(model=MODEL, prompt=prefix + "First", max_tokens=2,
                                      temperature=0.0)
    # Its blocks stay in the prefix cache but no request holds them: they count as free.
    assert wait_for_idle_pool(server.url)["pagedkv:kv_cache_usage_perc"] == 0.0
    second = client.completions.create(model=MODEL, prompt=prefix + "Second", max_tokens=2,
                                       temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % ENGINE_KWARGS["block_size"] == 0
    assert cached < second.usage.prompt_tokens
    salted = client.completions.create(model=MODEL, prompt=prefix + "Second", max_tokens=2,
                                       temperature=0.0, extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_64_concurrent_streams_match_offline(server, offline):
    prompts = [f"Request {i}: the scheduler admits {i * 7 % 13} blocks" for i in range(64)]
    expected = greedy_ids(offline, prompts, 8)

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[list[int], int]:
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, logprobs=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        ids, usage = [], 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                ids += token_ids(chunk.choices[0].logprobs.tokens)
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return ids, usage

    async def main() -> list[tuple[list[int], int]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(main())
    assert [ids for ids, _ in results] == expected
    assert [usage for _, usage in results] == [8] * 64
    metrics = wait_for_idle_pool(server.url)
    assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0


# Tokens the engine may still generate after the client has gone: the abort reaches the engine
# loop within a step or two (a few ms of the tiny model), far below the 1000 asked for.
AFTER_DISCONNECT_BOUND = 100


def test_streaming_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Disconnect me", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        received = [line for line in (next(lines) for _ in range(6)) if line]
        assert received and received[0].startswith("data: ")
        assert scrape(server.url)["pagedkv:num_requests_running"] == 1
    at_disconnect = scrape(server.url)["pagedkv:generation_tokens_total"]
    # The connection is closed mid-stream: the request must be aborted, its blocks returned.
    metrics = wait_for_idle_pool(server.url)
    assert metrics["pagedkv:num_requests_running"] == 0
    assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0
    time.sleep(0.3)
    after = scrape(server.url)["pagedkv:generation_tokens_total"]
    assert after - at_disconnect < AFTER_DISCONNECT_BOUND, "it kept generating after the disconnect"


def test_non_streaming_disconnect_aborts(server):
    body = {"model": MODEL, "prompt": "Wait for me", "max_tokens": 1000, "ignore_eos": True}
    # The client leaves after 0.1 s: the tiny model's 1,000 tokens take ~0.5 s with the fused
    # kernels on an idle machine, longer under load.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
    at_disconnect = scrape(server.url)["pagedkv:generation_tokens_total"]
    metrics = wait_for_idle_pool(server.url)
    assert metrics["pagedkv:num_requests_running"] == 0
    assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0
    time.sleep(0.3)
    after = scrape(server.url)["pagedkv:generation_tokens_total"]
    assert after - at_disconnect < AFTER_DISCONNECT_BOUND, "it kept running after the client left"


def test_metrics_names_and_counts(server, client):
    before = scrape(server.url)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0.0,
                              extra_body={"ignore_eos": True})
    after = wait_for_idle_pool(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert "pagedkv:" + name in after, name
    assert after["pagedkv:generation_tokens_total"] - before["pagedkv:generation_tokens_total"] == 5
    assert after["pagedkv:e2e_request_latency_seconds_count"] == (
        before["pagedkv:e2e_request_latency_seconds_count"] + 1)
    assert after["pagedkv:time_per_output_token_seconds_count"] == (
        before["pagedkv:time_per_output_token_seconds_count"] + 1)
