"""lm-evaluation-harness's scoring requests against a real server with the official `openai`
client: `echo` + `logprobs` + `max_tokens` 0 or 1 on token-id prompts, in OpenAI's layout, with
values equal to transformers' log-softmax on the same fp32 model; vLLM's `prompt_logprobs`."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tests.server.helpers import ENGINE_KWARGS, ServerProcess, engine_flags
from tests.tiny_models import load_hf_model

MODEL = "tiny"


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    model = load_hf_model(tiny_llama)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs


def check_echo_logprobs(choice, ids: list[int], ref: torch.Tensor, top_n: int) -> None:
    lp = choice.logprobs
    assert [int(t.removeprefix("token_id:")) for t in lp.tokens[:len(ids)]] == ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4)
        top = ref[i - 1].topk(top_n)
        expected = {f"token_id:{t}": v for t, v in zip(top.indices.tolist(), top.values.tolist(),
                                                       strict=True)}
        got = lp.top_logprobs[i]
        for token, value in expected.items():
            assert got[token] == pytest.approx(value, abs=1e-4)
        assert set(got) <= set(expected) | {f"token_id:{ids[i]}"}
    assert lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request(client, hf_logprobs, max_tokens):
    ids = [1, 17, 200, 33, 45, 300, 12, 99, 7, 150, 151, 152, 4]
    resp = client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=max_tokens, echo=True, logprobs=1, temperature=0,
        extra_body={"return_tokens_as_token_ids": True})
    choice = resp.choices[0]
    ref = hf_logprobs(ids)
    check_echo_logprobs(choice, ids, ref, 1)
    generated = len(choice.logprobs.tokens) - len(ids)
    assert generated == max_tokens
    assert resp.usage.completion_tokens == max_tokens
    assert resp.usage.prompt_tokens == len(ids)
    if max_tokens == 1:  # the greedy continuation, and its logprob
        token = int(choice.logprobs.tokens[-1].removeprefix("token_id:"))
        assert token == int(ref[-1].argmax())
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)


def test_echo_text_and_string_prompt(client, offline_tokenizer):
    prompt = "The quick brown fox jumps"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                     logprobs=2, temperature=0)
    choice = resp.choices[0]
    assert choice.text == prompt
    ids = offline_tokenizer.encode(prompt)
    assert len(choice.logprobs.tokens) == len(ids)
    assert choice.finish_reason == "length"
    # Offsets advance by each token's decoded text.
    lengths = [len(offline_tokenizer.decode([t], skip_special_tokens=False)) for t in ids]
    assert choice.logprobs.text_offset == [sum(lengths[:i]) for i in range(len(ids))]
    # echo without logprobs: the prompt then the continuation, no logprobs.
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True,
                                     temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert resp.choices[0].text == prompt + plain.choices[0].text
    assert resp.choices[0].logprobs is None


@pytest.fixture(scope="module")
def offline_tokenizer(tiny_llama):
    from pagedkv.model.tokenizer import Tokenizer
    return Tokenizer.from_dir(tiny_llama)


def test_echo_streaming_sends_the_prompt_first(client, hf_logprobs):
    ids = [1, 5, 6, 7, 8, 9, 10, 11]
    chunks = list(client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=2, echo=True, logprobs=1, temperature=0,
        stream=True, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True}))
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices for v in c.choices[0].logprobs.token_logprobs]
    assert [int(t.removeprefix("token_id:")) for t in tokens[:len(ids)]] == ids
    assert len(tokens) == len(ids) + 2
    ref = hf_logprobs(ids)
    assert values[0] is None
    assert values[1:len(ids)] == pytest.approx([float(ref[i - 1, ids[i]])
                                               for i in range(1, len(ids))], abs=1e-4)


def test_max_tokens_zero_needs_echo(server, client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)


def test_vllm_prompt_logprobs_field(server, hf_logprobs):
    ids = [1, 40, 41, 42, 43, 44]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2,
            "temperature": 0}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    entries = resp.json()["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        assert entries[i][str(ids[i])]["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]),
                                                                   abs=1e-4)
        top = ref[i - 1].topk(2).indices.tolist()
        assert {str(t) for t in top} <= set(entries[i])
    # The chat endpoint returns them at the top level.
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat.json()["prompt_logprobs"][1:])


def test_chunked_prefill_server_gives_the_same_values(tiny_llama, hf_logprobs):
    kwargs = {**ENGINE_KWARGS, "max_num_batched_tokens": 8}
    proc = ServerProcess(tiny_llama, *engine_flags(**kwargs)).start()
    try:
        ids = list(range(3, 40))
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        resp = client.completions.create(
            model=MODEL, prompt=[ids], max_tokens=0, echo=True, logprobs=3, temperature=0,
            extra_body={"return_tokens_as_token_ids": True})
        check_echo_logprobs(resp.choices[0], ids, hf_logprobs(ids), 3)
        json.dumps(resp.model_dump())
    finally:
        assert proc.stop()
