"""The server under hostile or careless use: swap preemption with a host pool that fills, huge
bodies and prompts (refused cheaply while /health answers), invalid Unicode, tiny
temperatures, a lower-case Bearer scheme, the default served model name, a busy port and a
graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.helpers import (
    REPO_ROOT,
    ServerProcess,
    engine_flags,
    scrape,
    serving,
    wait_for_idle_pool,
)

KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_REQUEST_BYTES = 2**20
# The tiny Llama's KV page is 2048 bytes with block size 4: 6 host blocks.
SWAP_SPACE = 6 * 2048 / 2**30
FLAGS = engine_flags(dtype="float32", block_size=4, max_model_len=128,
                     num_gpu_blocks_override=32, preemption_mode="swap", swap_space=SWAP_SPACE)


@pytest.fixture(scope="module")
def swap_server(tiny_llama):
    """The issue's repro server (32 blocks, swap, a host pool of 6 blocks), with an API key,
    a 1 MiB body limit and no --served-model-name."""
    with serving(ServerProcess(tiny_llama, *FLAGS, "--api-key", KEY, "--max-request-bytes",
                               str(MAX_REQUEST_BYTES), model_name=None)) as proc:
        yield proc


def post(url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=timeout)


def test_swap_mode_survives_a_full_host_pool(swap_server, tiny_llama):
    """120 concurrent n=2 completions on 31 blocks with 6 host blocks: every one answers 200
    with 2 full choices, swaps happened, and the server stays healthy."""
    name = str(tiny_llama)  # the default served model name: the model argument

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300, headers=AUTH) as client:
            return await asyncio.gather(*(client.post(swap_server.url + "/v1/completions", json={
                "model": name, "prompt": f"request {i} says", "max_tokens": 12, "n": 2,
                "temperature": 0.9, "seed": i, "ignore_eos": True}) for i in range(120)))

    responses = asyncio.run(main())
    for resp in responses:
        assert resp.status_code == 200, resp.text
        choices = resp.json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert httpx.get(swap_server.url + "/health").status_code == 200
    metrics = wait_for_idle_pool(swap_server.url)
    assert metrics["pagedkv:num_swaps_total"] > 0
    assert metrics["pagedkv:num_preemptions_total"] >= metrics["pagedkv:num_swaps_total"]


def test_default_served_model_name_is_the_model_argument(swap_server, tiny_llama):
    """As vLLM: the name is the model argument as given (here the directory's path); only
    that name is accepted, not the directory's basename."""
    models = httpx.get(swap_server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [str(tiny_llama)]
    resp = post(swap_server.url, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert resp.json()["model"] == str(tiny_llama)
    resp = post(swap_server.url, "/v1/completions",
                {"model": tiny_llama.name, "prompt": "x", "max_tokens": 1})
    assert resp.status_code == 404, resp.text


def test_bearer_scheme_is_case_insensitive(swap_server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        resp = httpx.get(swap_server.url + "/v1/models",
                         headers={"Authorization": f"{scheme} {KEY}"})
        assert resp.status_code == 200, scheme
    resp = httpx.get(swap_server.url + "/v1/models", headers={"Authorization": "bearer nope"})
    assert resp.status_code == 401


def test_body_over_the_limit_is_413(swap_server):
    big = {"prompt": "a" * (MAX_REQUEST_BYTES + 10), "max_tokens": 1}
    resp = post(swap_server.url, "/v1/completions", big)
    assert resp.status_code == 413
    error = resp.json()["error"]
    assert "--max-request-bytes" in error["message"] and error["type"] == "invalid_request_error"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    resp = httpx.post(swap_server.url + "/v1/completions", content=chunks(),
                      headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 413 and "too large" in resp.json()["error"]["message"]


def test_huge_prompt_is_refused_cheaply_while_health_answers(swap_server):
    """A ~1 MiB prompt (under the body limit) is far over max_model_len: 400 naming the
    context length, after tokenizing only a prefix, off the event loop: /health answers
    quickly meanwhile, every time."""
    prompt = "lorem ipsum dolor sit amet " * 38000  # ~1 MB of text
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        result["resp"] = post(swap_server.url, "/v1/completions",
                              {"prompt": prompt, "max_tokens": 1})

    sender = threading.Thread(target=send)
    sender.start()
    latencies = []
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(swap_server.url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.02)
    sender.join()
    resp = result["resp"]
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "maximum context length is 128 tokens" in message and "at least" in message
    assert max(latencies, default=0.0) < 1.0, latencies
    chat = post(swap_server.url, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
    assert chat.status_code == 400 and "at least" in chat.json()["error"]["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "abc\ud800def", "max_tokens": 1}),
    ("/v1/completions", {"prompt": ["ok", "\udfff"], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}),
    ("/v1/completions", {"prompt": "ok", "max_tokens": 1, "cache_salt": "\ud800"}),
    ("/v1/completions", {"prompt": "ok", "max_tokens": 1, "stop": ["\ud800"]}),
])
def test_lone_surrogate_is_400(swap_server, path, body):
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as a \ud800 escape
    resp = httpx.post(swap_server.url + path, content=raw, timeout=60,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_tiny_temperature_is_greedy(swap_server):
    body = {"prompt": "The tiny model says", "max_tokens": 8, "ignore_eos": True}
    greedy = post(swap_server.url, "/v1/completions", {**body, "temperature": 0.0}).json()
    for temperature in (1e-40, 1e-6):
        tiny = post(swap_server.url, "/v1/completions", {**body, "temperature": temperature})
        assert tiny.status_code == 200
        assert tiny.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_second_server_on_a_busy_port_fails_before_loading(swap_server, tiny_llama):
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", str(tiny_llama), "--port",
           str(swap_server.port), *FLAGS]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{swap_server.port}" in proc.stderr
    assert "Loading weights" not in proc.stderr and "Traceback" not in proc.stderr


def _read_sse(resp: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_then_exits_zero(tiny_llama, sig):
    """On a signal: a short request in flight finishes normally; a long stream and a long
    non-streaming request are ended after --shutdown-timeout (an error event and [DONE]; a
    503); new requests get 503 meanwhile; the process exits 0, every block returned."""
    # The long requests must outlast the 1.5 s drain: with the fused kernels the tiny model
    # decodes one sequence's 1,800 tokens in about a second, so each asks for 8 of them.
    proc = ServerProcess(tiny_llama, *engine_flags(dtype="float32", block_size=4,
                                                   max_model_len=2048,
                                                   num_gpu_blocks_override=8192),
                         "--shutdown-timeout", "1.5", "--log-level", "info").start()
    long_body = {"prompt": "go on", "max_tokens": 1800, "ignore_eos": True, "n": 8}
    results: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", proc.url + "/v1/completions", timeout=60,
                          json={**long_body, "stream": True}) as resp:
            results["stream"] = _read_sse(resp)

    def blocking() -> None:
        results["blocking"] = httpx.post(proc.url + "/v1/completions", json=long_body,
                                         timeout=60)

    def short() -> None:
        results["short"] = httpx.post(proc.url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 8, "ignore_eos": True})

    try:
        threads = [threading.Thread(target=f) for f in (stream, blocking)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while scrape(proc.url)["pagedkv:num_requests_running"] < 16:  # 2 requests x 8 samples
            assert time.monotonic() < deadline
            time.sleep(0.05)
        short_thread = threading.Thread(target=short)
        short_thread.start()
        while "short" not in results and scrape(proc.url)["pagedkv:num_requests_running"] < 17:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.proc.send_signal(sig)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # the listening socket is closed
            httpx.get(proc.url + "/health", timeout=5)
        for t in (*threads, short_thread):
            t.join(timeout=60)
        assert proc.proc.wait(timeout=60) == 0, proc.output()
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
    events = results["stream"]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "--shutdown-timeout" in error["message"] and error["type"] == "server_unavailable"
    assert results["blocking"].status_code == 503
    assert results["short"].status_code == 200
    assert results["short"].json()["usage"]["completion_tokens"] == 8
    assert "Traceback" not in proc.output()
