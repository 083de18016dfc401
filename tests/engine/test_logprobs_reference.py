"""The logprobs the engine and the server return equal `log_softmax` of transformers' logits
at every position (the sampled token's and the top-N), not only in the sampler's unit test."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from pagedkv import SamplingParams
from pagedkv.server.app import create_app
from tests.engine.conftest import _hf_model, assert_pool_empty

PROMPT = [1, 12, 250, 31, 77, 140, 9, 300]
TOP = 4
MAX_TOKENS = 6


def hf_logprobs(model_dir, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] log-probabilities transformers gives each output position."""
    model = _hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:-1].double(), dim=-1)


def assert_matches(reference: torch.Tensor, output: list[int],
                   entries: list[dict[int, float]]) -> None:
    assert len(entries) == len(output)
    for i, (token, entry) in enumerate(zip(output, entries, strict=True)):
        ref = reference[i]
        top = ref.topk(TOP).indices.tolist()
        assert set(entry) == {*top, token}, i
        for token_id, value in entry.items():
            assert value == pytest.approx(float(ref[token_id]), abs=2e-4), (i, token_id)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_logprobs_equal_transformers(tiny_llama, make_llm, temperature):
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=64, dtype="float32")
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=MAX_TOKENS,
                            ignore_eos=True, logprobs=TOP)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    reference = hf_logprobs(tiny_llama, PROMPT, out.token_ids)
    assert_matches(reference, out.token_ids, out.logprobs)
    want = sum(float(reference[i, t]) for i, t in enumerate(out.token_ids))
    assert out.cumulative_logprob == pytest.approx(want, abs=1e-3)
    assert_pool_empty(llm)


def test_server_logprobs_equal_transformers(tiny_llama, make_llm):
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=64, dtype="float32")
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": 3,
            "ignore_eos": True, "logprobs": TOP, "return_tokens_as_token_ids": True}
    with TestClient(create_app(llm.llm_engine, served_model_name="m")) as client:
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        logprobs = resp.json()["choices"][0]["logprobs"]
        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "logprobs": True, "top_logprobs": TOP,
            "return_tokens_as_token_ids": True})
        assert chat.status_code == 200, chat.text
    output = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    entries = [{int(k.removeprefix("token_id:")): v for k, v in top.items()}
               for top in logprobs["top_logprobs"]]
    for entry, token, value in zip(entries, output, logprobs["token_logprobs"], strict=True):
        assert entry[token] == value
    assert_matches(hf_logprobs(tiny_llama, PROMPT, output), output, entries)

    content = chat.json()["choices"][0]["logprobs"]["content"]
    chat_output = [int(c["token"].removeprefix("token_id:")) for c in content]
    chat_prompt = llm.get_tokenizer().encode(llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hello"}]), add_special_tokens=False)
    reference = hf_logprobs(tiny_llama, chat_prompt, chat_output)
    for i, c in enumerate(content):
        assert c["logprob"] == pytest.approx(float(reference[i, chat_output[i]]), abs=2e-4)
        tops = {int(t["token"].removeprefix("token_id:")): t["logprob"] for t in c["top_logprobs"]}
        assert set(tops) == set(reference[i].topk(TOP).indices.tolist())
