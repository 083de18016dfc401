"""`pagedkv serve <the .gguf file>` answers the openai client with transformers' greedy tokens
and logprobs on the real model (the engine core where $PAGEDKV_ENGINE_CORE says,
tests/server/helpers.py: `make test-process` serves it with the core in its own process)."""

from __future__ import annotations

import pytest

from pagedkv.model.tokenizer import Tokenizer
from tests.realmodel.conftest import TOP, assert_logprobs_match, hf_greedy, hf_logprobs
from tests.server.helpers import ServerProcess, engine_flags, serving

pytestmark = pytest.mark.real_model

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


def test_served_gguf_chat_equals_transformers(real_model_path, hf_real_model):
    from openai import OpenAI

    tokenizer = Tokenizer.from_dir(real_model_path)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    want = hf_greedy(hf_real_model, prompt, MAX_TOKENS)
    flags = engine_flags(dtype="float32", block_size=4, max_model_len=128,
                         num_gpu_blocks_override=64)
    with serving(ServerProcess(real_model_path, *flags,
                               model_name=None)) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        (model,) = [m.id for m in client.models.list().data]
        assert model == str(real_model_path)  # the model argument as given, as vLLM names it
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
            logprobs=True, top_logprobs=TOP, extra_body={"return_tokens_as_token_ids": True})
    choice = reply.choices[0]
    got = [int(c.token.removeprefix("token_id:")) for c in choice.logprobs.content]
    assert got == want
    assert choice.message.content == tokenizer.decode(want)
    assert "Paris" in choice.message.content
    entries = [{int(t.token.removeprefix("token_id:")): t.logprob for t in c.top_logprobs}
               | {int(c.token.removeprefix("token_id:")): c.logprob}
               for c in choice.logprobs.content]
    assert_logprobs_match(hf_logprobs(hf_real_model, prompt, got), got, entries)
