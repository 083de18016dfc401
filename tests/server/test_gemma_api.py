"""Gemma 2 and Gemma 3 (KV cache groups: sliding and full layers) served by `pagedkv serve`:
completions and chat answer with transformers' greedy tokens, a shared prefix is a cached hit
through the per-type rule, to the token with sub-block hits (`--prefix-match-unit 1`), and the
server ends idle with every block back (helpers.serving). One server per model for the module;
the transformers references are a few short prompts, each computed once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedkv.model.tokenizer import Tokenizer
from tests.engine.conftest import hf_greedy, make_prompts
from tests.server.helpers import ServerProcess, engine_flags, serving

MAX_TOKENS = 4
BLOCK_SIZE = 16
SHARED = 24  # the second prompt's tokens in common with the first: 1 block + 8 tokens


@pytest.fixture(scope="module", params=["tiny_gemma2", "tiny_gemma3"])
def gemma(request) -> Iterator[tuple[Path, str]]:
    """(the model directory, the server's URL): one server per model, checked idle at the end."""
    model_dir = request.getfixturevalue(request.param)
    flags = engine_flags(dtype="float32", block_size=BLOCK_SIZE, max_model_len=128,
                         num_gpu_blocks_override=64, prefix_match_unit=1, seed=0)
    with serving(ServerProcess(model_dir, *flags)) as proc:
        yield model_dir, proc.url


@pytest.mark.timeout(120)
def test_completions_greedy_and_sub_block_hit(gemma):
    """Two prompts sharing 24 tokens, one after the other: the second hits all 24 (one whole
    block and 8 tokens of the next, in every group), and both answer with transformers' tokens."""
    model_dir, url = gemma
    first, other = make_prompts(seed=7, vocab=400, num=2, shared_prefix=0, lengths=(30, 30))
    cached = []
    for prompt in (first, first[:SHARED] + other[:6]):
        r = httpx.post(url + "/v1/completions", timeout=60, json=dict(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            ignore_eos=True, return_token_ids=True))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == hf_greedy(model_dir, prompt, MAX_TOKENS)
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, SHARED]


@pytest.mark.timeout(120)
def test_chat_greedy(gemma):
    """The ids the chat endpoint feeds the model, then its greedy answer and that answer's text."""
    model_dir, url = gemma
    messages = [{"role": "user", "content": "the quick brown fox"}]
    ids = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30)
    assert ids.status_code == 200, ids.text
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=dict(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
        ignore_eos=True, return_token_ids=True))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == hf_greedy(model_dir, ids.json()["tokens"], MAX_TOKENS)
    # The text is those tokens' (an incomplete UTF-8 tail is held back, as vLLM does).
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.decode(choice["token_ids"]).startswith(choice["message"]["content"])
