"""kv-aware without --model (issue 21, item 2): the router asks a backend's /tokenize for the
prompt's ids and hashes them; the hashes equal those of a router holding the model's own
tokenizer and chat template, for completions (text and ids) and chat (tools included)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.router.backend import Backend
from pagedkv.router.health import HealthChecker
from pagedkv.router.policies import KVAwarePolicy
from pagedkv.router.prompt import CHAT_COMPLETIONS, COMPLETIONS, PromptHasher
from pagedkv.router.proxy import Forwarder
from pagedkv.router.remote_tokens import tokenize_call
from pagedkv.router.router import Router
from pagedkv.server.app import create_app
from tests.router.fake_backend import ThreadServer

pytestmark = pytest.mark.timeout(120, method="thread")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
BODIES = [
    (COMPLETIONS, {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog, "
                   "again and again, and then once more.", "cache_salt": "tenant-1"}),
    (COMPLETIONS, {"model": "m", "prompt": [["x"], 1], "max_tokens": 1}),  # bad: no hashes
    (COMPLETIONS, {"prompt": [list(range(1, 20)), [5, 6]]}),  # ids: placed by the first
    (COMPLETIONS, {"model": "m", "prompt": "No BOS here, the client says: only the text.",
                   "add_special_tokens": False}),
    (CHAT_COMPLETIONS, {"model": "m", "messages": [
        {"role": "system", "content": "You are a terse assistant for acme."},
        {"role": "user", "content": "What is the weather in Paris today, please?"}]}),
    (CHAT_COMPLETIONS, {"model": "m", "tools": TOOLS, "tool_choice": "none", "messages": [
        {"role": "user", "content": "What is the weather in Paris today, please?"}]}),
    (CHAT_COMPLETIONS, {"model": "m", "add_special_tokens": True, "messages": [
        {"role": "user", "content": "What is the weather in Paris today, please?"}]}),
]


def test_hashes_from_a_backends_tokenize_equal_the_local_tokenizers(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=256, num_gpu_blocks_override=32))
    local = PromptHasher(Tokenizer.from_dir(tiny_llama), block_size=4, hash_algo="sha256")
    tokenize_calls: list[str] = []

    async def scenario(url: str) -> None:
        async def log(request: httpx.Request) -> None:
            if request.url.path == "/tokenize":
                tokenize_calls.append(request.url.path)

        async with httpx.AsyncClient(event_hooks={"request": [log]}) as client:
            router = Router([Backend(url)], KVAwarePolicy())  # no tokenizer of its own
            assert await HealthChecker(router, client).check_all() == 1
            assert router.hash_settings == (4, "sha256") and router.needs_prompt_hashes
            forwarder = Forwarder(router, client)
            for path, body in BODIES:
                raw = json.dumps(body).encode()
                remote = await asyncio.wait_for(
                    forwarder.hashed_request(path, raw, None, body.get("model")), timeout=30)
                expected = local.route_request(path, raw)
                assert remote.block_hashes == expected.block_hashes, body
                assert remote.prompt_tokens == expected.prompt_tokens, body
                assert remote.model == body.get("model")
            assert router.hasher.tokenizer is None

    with ThreadServer(create_app(engine, served_model_name="m"), lifespan="on") as server:
        asyncio.run(scenario(server.url))
    assert len(tokenize_calls) == 5  # the ids prompt needs none, the bad one gets none


def test_tokenize_call_shapes():
    salted = tokenize_call(COMPLETIONS, b'{"prompt": ["a", "b"], "cache_salt": "s"}')
    assert salted.payload == {"prompt": "a", "add_special_tokens": True}
    assert salted.cache_salt == "s"
    assert tokenize_call(COMPLETIONS, b'{"prompt": [3, 4]}').token_ids == [3, 4]
    chat = tokenize_call(CHAT_COMPLETIONS, json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
        "add_generation_prompt": None, "chat_template_kwargs": {"x": 1}}).encode())
    assert chat.payload == {"messages": [{"role": "user", "content": "hi"}],
                            "chat_template_kwargs": {"x": 1}, "add_special_tokens": False}
    for path, body in [(COMPLETIONS, b"not json"), (COMPLETIONS, b"[1]"),
                       (COMPLETIONS, b'{"prompt": [true]}'), (CHAT_COMPLETIONS, b"{}"),
                       ("/v1/other", b'{"prompt": "x"}')]:
        assert tokenize_call(path, body) is None


def test_a_backend_that_cannot_tokenize_in_time_leaves_the_request_to_load_alone():
    from pagedkv.router.remote_tokens import BackendTokenizer

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "slow.test":
            await asyncio.sleep(3600)
        if request.url.host == "junk.test":
            return httpx.Response(200, json={"tokens": ["not", "ids"]})
        return httpx.Response(401, json={"error": {"message": "key"}})

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            tokenizer = BackendTokenizer(client, {}, timeout_s=0.2)
            call = tokenize_call(COMPLETIONS, b'{"prompt": "hello"}')
            for url in ("http://slow.test", "http://junk.test", "http://denied.test"):
                assert await asyncio.wait_for(tokenizer.token_ids(url, call), 5) is None

    start = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - start < 3
