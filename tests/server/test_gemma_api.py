"""Gemma 2 and Gemma 3 (KV cache groups: sliding and full layers) served by `pagedkv serve`:
completions and chat answer with transformers' greedy tokens, a shared prefix is a cached hit
through the per-type rule, and the server ends idle with every block back."""

from __future__ import annotations

import httpx
import pytest

from pagedkv.model.tokenizer import Tokenizer
from tests.engine.conftest import hf_greedy, make_prompts
from tests.server.helpers import ServerProcess, engine_flags, serving

MAX_TOKENS = 8


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["tiny_gemma2", "tiny_gemma3"])
def test_gemma_served_greedy_equals_transformers(request, model):
    model_dir = request.getfixturevalue(model)
    tokenizer = Tokenizer.from_dir(model_dir)
    flags = engine_flags(dtype="float32", block_size=4, max_model_len=256,
                         num_gpu_blocks_override=256, seed=0)
    with serving(ServerProcess(model_dir, *flags)) as proc:
        url = proc.url
        # Completions: two prompts sharing 24 tokens, one after the other (the second hits).
        first, other = make_prompts(seed=7, vocab=400, num=2, shared_prefix=0, lengths=(30, 30))
        prompts = [first, first[:24] + other[:6]]
        cached = []
        for prompt in prompts:
            r = httpx.post(url + "/v1/completions", timeout=120, json=dict(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                ignore_eos=True, return_token_ids=True))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["token_ids"] == hf_greedy(model_dir, prompt, MAX_TOKENS)
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0 and cached[1] >= 16  # whole blocks every group can serve
        # Chat: the ids the chat endpoint feeds the model, then its greedy answer.
        messages = [{"role": "user", "content": "the quick brown fox"}]
        ids = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30)
        assert ids.status_code == 200, ids.text
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json=dict(
            model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
            ignore_eos=True, return_token_ids=True))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == hf_greedy(model_dir, ids.json()["tokens"], MAX_TOKENS)
        # The text is those tokens' (an incomplete UTF-8 tail is held back, as vLLM does).
        assert tokenizer.decode(choice["token_ids"]).startswith(choice["message"]["content"])
