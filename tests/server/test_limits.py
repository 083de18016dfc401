"""API-key enforcement, the bounded in-flight queue (503) and a KV cache too small for `n`,
on a server started with --api-key, --max-pending 1 and a 200-block cache."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.server.helpers import ServerProcess, engine_flags, serving, wait_for_idle_pool

KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def limited(tiny_llama):
    with serving(ServerProcess(tiny_llama, "--api-key", KEY, "--max-pending", "1",
                               *engine_flags(dtype="float32", block_size=4, max_model_len=512,
                                             num_gpu_blocks_override=200))) as proc:
        yield proc


def completion(url: str, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body},
                      headers=headers or {}, timeout=60)


def test_v1_routes_need_the_key(limited):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        for resp in (completion(limited.url, headers),
                     httpx.get(limited.url + "/v1/models", headers=headers),
                     httpx.post(limited.url + "/v1/chat/completions", headers=headers,
                                json={"messages": [{"role": "user", "content": "x"}]}),
                     httpx.post(limited.url + "/tokenize", headers=headers,
                                json={"prompt": "hi"}),
                     httpx.post(limited.url + "/detokenize", headers=headers,
                                json={"tokens": [5, 6]})):
            assert resp.status_code == 401, (headers, resp.text)
            assert resp.json()["error"]["type"] == "authentication_error"
    assert completion(limited.url, AUTH).status_code == 200
    assert httpx.get(limited.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.post(limited.url + "/tokenize", headers=AUTH,
                      json={"prompt": "hi"}).json()["count"] >= 1
    assert httpx.post(limited.url + "/detokenize", headers=AUTH,
                      json={"tokens": [5, 6]}).status_code == 200
    # Health, version and metrics stay open (load balancers and Prometheus have no key).
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(limited.url + path).status_code == 200


def test_openai_client_with_and_without_key(limited):
    wrong = openai.OpenAI(base_url=limited.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="x", max_tokens=2)
    right = openai.OpenAI(base_url=limited.url + "/v1", api_key=KEY, max_retries=0)
    resp = right.completions.create(model="tiny", prompt="x", max_tokens=3,
                                    extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3


def overloaded_answers(url: str) -> list[httpx.Response] | None:
    """A completion and a chat request sent while a 500-token stream runs, or None when the
    stream had already ended before they were answered (the tiny model can decode 500 tokens
    faster than a loaded client sends two requests)."""
    body = {"model": "tiny", "prompt": "long", "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as long_request:
        assert long_request.status_code == 200
        lines = long_request.iter_lines()  # kept: dropping it would close the connection
        assert next(lines).startswith("data: ")  # it is running now
        busy = completion(url, AUTH)
        chat = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=60,
                          json={"messages": [{"role": "user", "content": "x"}]})
    if busy.status_code == 200 or chat.status_code == 200:
        return None
    return [busy, chat]


def test_503_when_overloaded_then_recovers(limited):
    for _ in range(3):  # a run the stream outpaced says nothing; a server that never refuses fails
        answers = overloaded_answers(limited.url)
        wait_for_idle_pool(limited.url)
        if answers is not None:
            break
    assert answers is not None, "no request was refused while a 500-token stream ran (3 tries)"
    busy, chat = answers
    assert busy.status_code == 503, busy.text
    assert busy.json()["error"]["code"] == 503  # vLLM's: the status
    assert busy.json()["error"]["type"] == "server_overloaded"
    assert chat.status_code == 503
    assert completion(limited.url, AUTH).status_code == 200


def test_n_that_can_never_fit_is_a_400(limited):
    resp = completion(limited.url, AUTH, n=250)  # 250 sequences need > 200 blocks
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "n"
    resp = httpx.post(limited.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "x"}], "n": 250,
                            "max_tokens": 2})
    assert resp.status_code == 400
    assert completion(limited.url, AUTH, n=4).status_code == 200


def test_health_answers_while_huge_tokenize_requests_run(limited):
    """Three 4 MB /tokenize bodies (text and chat) at once: they are tokenized off the event
    loop and refused once a prefix is over max_model_len; /health answers in well under 1 s
    all the while."""
    text = "hello world " * (4_000_000 // 12)
    bodies = [{"prompt": text}, {"prompt": text},
              {"messages": [{"role": "user", "content": text}]}]
    answers: list[httpx.Response] = []

    def send(body):
        answers.append(httpx.post(limited.url + "/tokenize", json=body, headers=AUTH,
                                  timeout=120))

    senders = [threading.Thread(target=send, args=(b,)) for b in bodies]
    for sender in senders:
        sender.start()
    worst = 0.0
    while any(sender.is_alive() for sender in senders):
        started = time.monotonic()
        assert httpx.get(limited.url + "/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.02)
    for sender in senders:
        sender.join()
    assert worst < 1.0, worst
    assert sorted(a.status_code for a in answers) == [400, 400, 400], [a.text for a in answers]
    assert {a.json()["error"]["param"] for a in answers} == {"prompt", "messages"}
    assert "maximum context length" in answers[0].json()["error"]["message"]
    too_many = httpx.post(limited.url + "/detokenize", headers=AUTH, json={"tokens": [5] * 513})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "tokens"
