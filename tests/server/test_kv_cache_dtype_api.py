"""`pagedkv serve --kv-cache-dtype F` for each kind of quantized format (int8 with
per-token-head scales, fp8 with calibrated per-head scales), driven by the official `openai`
client, with the engine core where $PAGEDKV_ENGINE_CORE says (tests/server/helpers.py): greedy tokens and their logprobs equal the offline `LLM`'s
with the same format (the quantization is deterministic, so a server is no less exact than
the engine it wraps), through completions, chat, streaming, n > 1 (copy-on-write forks),
prompt logprobs, stop strings and structured output; /kv_cache_info, /metrics and the
dashboard name the format and the block's bytes (scales included). The fixture's teardown
checks that no block is held and that the server stops cleanly.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedkv import LLM, SamplingParams
from tests.dashboard.conftest import sse_events
from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags, serving

MODEL = "tiny"
# "fp8" is e4m3, as in vLLM; e5m2 differs from it only in the engine (tests/engine).
FORMATS = ("int8", "fp8")
# tiny_llama: 2 layers x K,V x 2 KV heads x head 16, block 4: one byte a value, int8 also a
# float32 scale per token, head, layer and K or V.
BLOCK_BYTES = {"int8": 4 * 2 * 2 * 2 * (16 + 4), "fp8": 4 * 2 * 2 * 2 * 16}
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})


@pytest.fixture(scope="module", params=FORMATS)
def fmt(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(tiny_llama, fmt):
    flags = engine_flags(**ENGINE_KWARGS, kv_cache_dtype=fmt)
    with serving(ServerProcess(tiny_llama, *flags)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama, fmt):
    llm = LLM(str(tiny_llama), **ENGINE_KWARGS, kv_cache_dtype=fmt)
    yield llm
    llm.llm_engine.check_invariants()
    llm.shutdown()


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def offline_greedy(llm: LLM, prompt, max_tokens: int, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_completion_tokens_and_logprobs_equal_the_offline_engines(client, offline):
    prompt = "The quick brown fox jumps over the lazy dog and keeps running"
    expected = offline_greedy(offline, prompt, 12, logprobs=2).outputs[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, logprobs=2,
                                     **GREEDY)
    lp = resp.choices[0].logprobs
    assert ids_of(lp.tokens) == list(expected.token_ids)
    for got, want, token in zip(lp.token_logprobs, expected.logprobs, expected.token_ids,
                                strict=True):
        assert got == pytest.approx(want[token], abs=1e-5)


def test_chat_and_streaming_equal_the_offline_engines(client, offline):
    messages = [{"role": "user", "content": "Tell me about paged attention."}]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=10,
                                                     ignore_eos=True), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                          **GREEDY)
    assert resp.choices[0].message.content == expected.outputs[0].text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                            stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        expected.outputs[0].text
    prompt = "Once upon a time"
    want = offline_greedy(offline, prompt, 10).outputs[0].text
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, stream=True,
                                       **GREEDY)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_n_and_best_of_forks_share_the_prompt_blocks(client, offline):
    """n = best_of = 3 greedy samples fork one prompt (its partial last block copied on
    write, int8 with its scales): each equals the single greedy output; sampled forks with a
    seed repeat exactly."""
    prompt = [7, 19, 23, 101, 55, 8, 300, 42, 11]  # 9 tokens: a partial third block
    want = list(offline_greedy(offline, {"prompt_token_ids": prompt}, 8).outputs[0].token_ids)
    for extra in ({"n": 3}, {"n": 3, "best_of": 3}):  # top_k 1: greedy, as n > 1 needs
        resp = client.completions.create(
            model=MODEL, prompt=[prompt], max_tokens=8, logprobs=0, temperature=1.0, **extra,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, "top_k": 1})
        assert [ids_of(c.logprobs.tokens) for c in resp.choices] == [want] * 3
    sampled = dict(model=MODEL, prompt=[prompt], max_tokens=8, n=3, temperature=1.0, seed=5,
                   extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**sampled).choices]
    assert first == [c.text for c in client.completions.create(**sampled).choices]


def test_prompt_logprobs_equal_the_offline_engines(server, offline):
    ids = [1, 17, 200, 33, 45, 300, 12, 99, 7, 150, 151, 152, 4]
    expected = offline_greedy(offline, {"prompt_token_ids": ids}, 1,
                              prompt_logprobs=2).prompt_logprobs
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2,
            "temperature": 0}
    entries = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()[
        "choices"][0]["prompt_logprobs"]
    assert entries[0] is None and expected[0] is None
    for got, want, token in zip(entries[1:], expected[1:], ids[1:], strict=True):
        assert got[str(token)]["logprob"] == pytest.approx(want[token], abs=1e-5)
        assert {int(t) for t in got} == set(want)


def test_stop_string_cuts_the_quantized_caches_output(client, offline):
    prompt = "Numbers: 0 1 2"
    full = offline_greedy(offline, prompt, 16).outputs[0].text
    stop = full[4:6]
    assert stop and stop in full
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop],
                                     **GREEDY)
    assert resp.choices[0].text == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_structured_output_over_a_quantized_cache(client):
    schema = {"type": "object", "properties": {"kind": {"enum": ["book", "pen"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["kind", "n"], "additionalProperties": False}
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "An item as JSON"}], n=2,
        temperature=1.0, seed=3, max_tokens=60,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "item", "schema": schema, "strict": True}})
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    choice = client.completions.create(model=MODEL, prompt="Colour:", max_tokens=10,
                                       extra_body={"structured_outputs": {
                                           "choice": ["red", "green"]}})
    assert choice.choices[0].text in ("red", "green")


def test_kv_cache_info_and_metrics_name_the_format_and_its_block_bytes(server, fmt):
    info = httpx.get(server.url + "/kv_cache_info", timeout=10).json()
    assert info["kv_cache_dtype"] == fmt
    assert info["block_bytes"] == BLOCK_BYTES[fmt]
    assert info["num_gpu_blocks"] == ENGINE_KWARGS["num_gpu_blocks_override"]
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert f'cache_dtype="{fmt}"' in metrics
    explain = httpx.post(server.url + "/v1/cache/explain", timeout=10,
                         json={"model": MODEL, "prompt": "a miss"}).json()
    assert explain["kv_cache_dtype"] == fmt
    with httpx.stream("GET", server.url + "/dashboard/events", timeout=30) as resp:
        name, snap = next(sse_events(resp))
    assert name == "snapshot"
    assert (snap["kv_cache_dtype"], snap["block_bytes"]) == (fmt, BLOCK_BYTES[fmt])
