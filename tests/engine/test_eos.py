"""eos stopping through the engine and the HTTP server, on the tiny Llama whose eos token is
set to a token greedy decoding reaches: generation stops there ("stop"), `ignore_eos` runs on,
and `min_tokens` bans eos until reached, exactly as transformers with eos masked does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from pagedkv import SamplingParams
from pagedkv.server.app import create_app
from tests.engine.conftest import _hf_model, assert_pool_empty, hf_greedy

PROMPT = [1, 45, 97, 130, 201, 17, 66]
EOS_INDEX = 3  # greedy decoding emits eos as its 4th token


def hf_greedy_with_eos(model_dir: Path, prompt: list[int], eos: int, min_tokens: int,
                       max_tokens: int) -> list[int]:
    """transformers' greedy decoding with eos masked below min_tokens, stopping at eos."""
    model = _hf_model(model_dir)
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = model(torch.tensor([ids])).logits[0, -1]
            if len(out) < min_tokens:
                logits[eos] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


@pytest.fixture(scope="module")
def eos_model(tiny_llama, tmp_path_factory) -> tuple[Path, int]:
    """A copy of the tiny Llama whose only eos token is greedy's 4th token after PROMPT."""
    greedy = hf_greedy(tiny_llama, PROMPT, 12)
    eos = greedy[EOS_INDEX]
    assert eos not in greedy[:EOS_INDEX]
    model_dir = tmp_path_factory.mktemp("eos") / "tiny_eos"
    shutil.copytree(tiny_llama, model_dir)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((model_dir / name).read_text())
        data["eos_token_id"] = eos
        (model_dir / name).write_text(json.dumps(data))
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = None  # else "</s>" would be a second eos
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model_dir, eos


def test_engine_stops_at_eos(eos_model, make_llm):
    model_dir, eos = eos_model
    llm = make_llm(model_dir, block_size=4, num_gpu_blocks_override=64, dtype="float32")
    assert llm.llm_engine.eos_token_ids == (eos,)
    prompt = {"prompt_token_ids": PROMPT}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(model_dir, PROMPT, 12)[:EOS_INDEX + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(model_dir, PROMPT, 12)
    assert out.finish_reason == "length"
    for min_tokens in (2, 6):
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                  min_tokens=min_tokens), use_tqdm=False)[0]
        want = hf_greedy_with_eos(model_dir, PROMPT, eos, min_tokens, 12)
        assert out.outputs[0].token_ids == want, min_tokens
        assert eos not in want[:min_tokens]
    assert_pool_empty(llm)


def test_server_stops_at_eos(eos_model, make_llm):
    model_dir, eos = eos_model
    llm = make_llm(model_dir, block_size=4, num_gpu_blocks_override=64, dtype="float32")
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "logprobs": 0,
            "return_tokens_as_token_ids": True}

    def tokens(choice: dict) -> list[int]:
        return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]

    with TestClient(create_app(llm.llm_engine, served_model_name="m")) as client:
        stopped = client.post("/v1/completions", json=body).json()["choices"][0]
        assert tokens(stopped) == hf_greedy(model_dir, PROMPT, 12)[:EOS_INDEX + 1]
        assert stopped["finish_reason"] == "stop"
        banned = client.post("/v1/completions", json={**body, "min_tokens": 6}).json()
        assert tokens(banned["choices"][0]) == hf_greedy_with_eos(model_dir, PROMPT, eos, 6, 12)
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: {")]
        assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"
        assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == EOS_INDEX + 1
