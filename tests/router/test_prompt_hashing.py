"""The router tokenizes and hashes prompts as the engine does."""

from __future__ import annotations

import json

import pytest

from pagedkv.kv.hashing import get_hash_fn, hash_block_tokens, request_extra_keys
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.router.prompt import CHAT_COMPLETIONS, COMPLETIONS, PromptHasher
from pagedkv.testing import build_tokenizer_files


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_tokenizer_files(tmp_path_factory.mktemp("tok")))


def chain(ids: list[int], block_size: int, algo: str, salt: str | None) -> list[bytes]:
    """The engine's chained hashes spelled out block by block."""
    fn, parent, out = get_hash_fn(algo), None, []
    for i in range(len(ids) // block_size):
        keys = request_extra_keys(salt, None, first_block=i == 0)
        parent = hash_block_tokens(fn, parent, ids[i * block_size:(i + 1) * block_size], keys)
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_completion_hashes_equal_the_engines(tokenizer, algo):
    hasher = PromptHasher(tokenizer, block_size=4, hash_algo=algo)
    text = "The quick brown fox jumps over the lazy dog, again and again."
    body = json.dumps({"prompt": text, "cache_salt": "tenant-1"}).encode()
    req = hasher.route_request(COMPLETIONS, body)
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert req.prompt_tokens == len(ids)
    assert list(req.block_hashes) == chain(ids, 4, algo, "tenant-1")
    assert len(req.block_hashes) == len(ids) // 4 > 2
    unsalted = hasher.route_request(COMPLETIONS, json.dumps({"prompt": text}).encode())
    assert not set(unsalted.block_hashes) & set(req.block_hashes)  # the salt changes every hash


def test_add_special_tokens_and_only_the_first_prompt_as_the_server(tokenizer):
    """A completion without BOS when `add_special_tokens` is false (the server's default is
    true), a chat with the tokenizer's special tokens only when true; a list of prompts is
    placed by its first, and only that one is tokenized."""
    hasher = PromptHasher(tokenizer, block_size=4, hash_algo="sha256")
    text = "The quick brown fox jumps over the lazy dog, again and again."
    with_bos = tokenizer.encode(text, add_special_tokens=True)
    without = tokenizer.encode(text, add_special_tokens=False)
    assert with_bos != without
    for flag, ids in ((None, with_bos), (True, with_bos), (False, without)):
        body = {"prompt": text} | ({} if flag is None else {"add_special_tokens": flag})
        req = hasher.route_request(COMPLETIONS, json.dumps(body).encode())
        assert list(req.block_hashes) == chain(ids, 4, "sha256", None), flag
    messages = [{"role": "user", "content": "hi there, how are you today?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    for flag, special in ((None, False), (False, False), (True, True)):
        body = {"messages": messages} | ({} if flag is None else {"add_special_tokens": flag})
        req = hasher.route_request(CHAT_COMPLETIONS, json.dumps(body).encode())
        ids = tokenizer.encode(rendered, add_special_tokens=special)
        assert list(req.block_hashes) == chain(ids, 4, "sha256", None), flag
    encoded: list[str] = []
    original = tokenizer.encode_bounded

    def spy(text_: str, *args, **kwargs):
        encoded.append(text_)
        return original(text_, *args, **kwargs)

    tokenizer.encode_bounded = spy
    try:
        req = hasher.route_request(COMPLETIONS, json.dumps({"prompt": [text, "b" * 500]}).encode())
    finally:
        del tokenizer.encode_bounded
    assert encoded == [text] and list(req.block_hashes) == chain(with_bos, 4, "sha256", None)


def test_chat_uses_the_template_and_token_prompts_pass_through(tokenizer):
    hasher = PromptHasher(tokenizer, block_size=4, hash_algo="sha256")
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "hi there"}]
    req = hasher.route_request(CHAT_COMPLETIONS, json.dumps({"messages": messages}).encode())
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert list(req.block_hashes) == chain(ids, 4, "sha256", None)
    tokens = list(range(5, 23))
    req = hasher.route_request(COMPLETIONS, json.dumps({"prompt": [tokens, [1, 2]]}).encode())
    assert req.prompt_tokens == 18 and list(req.block_hashes) == chain(tokens, 4, "sha256", None)


def test_a_body_the_server_rejects_gets_no_hashes(tokenizer):
    hasher = PromptHasher(tokenizer, block_size=4, hash_algo="sha256")
    for body in (b"not json", b'{"prompt": 3}', b'{"messages": []}'):
        path = CHAT_COMPLETIONS if b"messages" in body else COMPLETIONS
        req = hasher.route_request(path, body, session="s")
        assert req.block_hashes == () and req.prompt_tokens == 0 and req.session == "s"
