"""Outputs cut inside multi-byte characters through the HTTP API: every answer's text is what
vLLM 0.32's detokenizer makes (tokenizers' DecodeStream, pagedkv.testing.vllm_text), streamed
or not, completions and chat, n > 1, stop strings and echo; a stream's deltas add up to the
final text."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedkv.model.tokenizer import Tokenizer
from pagedkv.testing.vllm_text import vllm_output_text

CHAT = [{"role": "user", "content": "Tell me a story"}]
PATHS = [("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": CHAT})]


@pytest.fixture(scope="module")
def tok(server) -> Tokenizer:
    return Tokenizer.from_dir(server.model_dir)


@pytest.fixture(scope="module")
def byte_tokens(tok) -> list[int]:
    return sorted(set(tok.encode("日本語のテキスト😀", add_special_tokens=False)))


def text_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"] or ""


def delta_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


def prompt_ids(resp: dict, choice: dict) -> list[int]:
    """(completions carry them per choice, chat per answer, as vLLM)"""
    return choice.get("prompt_token_ids") or resp["prompt_token_ids"]


def answer(server, path: str, body: dict) -> dict:
    resp = httpx.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def streamed(server, path: str, body: dict) -> dict[int, str]:
    """Each choice's concatenated deltas."""
    texts: dict[int, str] = {}
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + delta_of(choice)
    return texts


@pytest.mark.parametrize("path, base", PATHS)
def test_cut_at_every_length_is_vllms_text_streamed_or_not(server, tok, byte_tokens, path,
                                                           base):
    for max_tokens in range(1, 6):
        body = {**base, "temperature": 0.0, "max_tokens": max_tokens,
                "allowed_token_ids": byte_tokens, "return_token_ids": True}
        resp = answer(server, path, body)
        (choice,) = resp["choices"]
        expected = vllm_output_text(tok.backend_tokenizer, prompt_ids(resp, choice),
                                    choice["token_ids"])
        assert text_of(choice) == expected, max_tokens
        assert "\ufffd" not in expected
        assert streamed(server, path, body) == {0: expected}


@pytest.mark.parametrize("path, base", PATHS)
def test_n_samples_stop_strings_and_echo(server, tok, byte_tokens, path, base):
    raw = tok.backend_tokenizer
    body = {**base, "temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 6,
            "allowed_token_ids": byte_tokens, "return_token_ids": True}
    resp = answer(server, path, body)
    texts = {}
    for choice in resp["choices"]:
        texts[choice["index"]] = text_of(choice)
        assert texts[choice["index"]] == vllm_output_text(raw, prompt_ids(resp, choice),
                                                          choice["token_ids"])
    assert streamed(server, path, body) == texts
    # A two-character stop string from the greedy text: cut there, never streamed.
    greedy = {**base, "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    full = text_of(answer(server, path, greedy)["choices"][0])
    assert len(full) >= 3
    stop = full[1:3]
    cut = answer(server, path, {**greedy, "stop": [stop]})["choices"][0]
    assert text_of(cut) == full[:full.find(stop)] and cut["finish_reason"] == "stop"
    assert streamed(server, path, {**greedy, "stop": [stop]}) == {0: text_of(cut)}
    if path == "/v1/completions":
        echoed = answer(server, path, {**greedy, "max_tokens": 3, "echo": True})["choices"][0]
        plain = answer(server, path, {**greedy, "max_tokens": 3})["choices"][0]
        assert text_of(echoed) == base["prompt"] + text_of(plain)
