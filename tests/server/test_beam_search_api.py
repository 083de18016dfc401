"""`use_beam_search` on the served API (vLLM's fields): `n` beams come back as the choices,
best first, equal to transformers' `generate(num_beams=n)`; `length_penalty` and
`early_stopping` reach the search; streaming and what beam search cannot honour are 400s."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.test_beam_search import hf_beams

PROMPT = [5, 77, 130, 9, 251, 31, 64, 300, 12, 41, 99, 180, 7]
CHAT = [{"role": "user", "content": "Tell me a story"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (2.0, True),
                                                            (0.5, "never")])
def test_completions_beams_equal_transformers(server, tiny_llama, length_penalty,
                                              early_stopping):
    resp = post(server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 5, "n": 3, "use_beam_search": True,
        "length_penalty": length_penalty, "early_stopping": early_stopping,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    beams, _ = hf_beams(tiny_llama, PROMPT, width=3, max_tokens=5,
                        length_penalty=length_penalty, early_stopping=early_stopping)
    assert [c["token_ids"] for c in choices] == beams
    assert resp.json()["usage"]["completion_tokens"] == sum(len(b) for b in beams)


def test_chat_beams(server):
    resp = post(server, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 4, "n": 2, "use_beam_search": True,
        "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 2 and choices[0]["token_ids"] != choices[1]["token_ids"]


@pytest.mark.parametrize("extra, param", [({"stream": True}, "stream"),
                                          ({"stop": ["x"]}, "stop"),
                                          ({"min_tokens": 2}, "min_tokens"),
                                          ({"prompt_logprobs": 1}, "prompt_logprobs")])
def test_what_beam_search_cannot_do_is_400(server, extra, param):
    for path, base in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        resp = post(server, path, {**base, "max_tokens": 3, "n": 2, "use_beam_search": True,
                                   **extra})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["code"] == 400, error
        assert "use_beam_search" in error["message"]


def test_echo_with_beam_search_is_400(server):
    resp = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "n": 2,
                                            "use_beam_search": True, "echo": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo", resp.text


def test_logprobs_of_the_beams(server):
    """`logprobs` with beam search: each choice has a logprob and the top alternatives for
    every token."""
    resp = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 2,
                                            "use_beam_search": True, "logprobs": 2})
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == 4
        assert all(len(top) >= 2 for top in logprobs["top_logprobs"])
