"""Three real `pagedkv serve` processes behind a real `pagedkv router` (kv-aware, own-record
mode: no KV events): two of the module's and the session's main server. The module shares them;
the test that kills a backend (one of the module's) runs last and restarts it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from pagedkv import LLM, SamplingParams
from tests.router.helpers import RouterProcess, router_metric
from tests.server.helpers import (
    ENGINE_KWARGS,
    ServerProcess,
    engine_flags,
    scrape,
    wait_for_idle_pool,
)

BACKEND_HEADER = "x-pagedkv-backend"
SYSTEM = {  # per-tenant system prompts, many blocks of 4 tokens, no prefix in common
    t: f"{t} assistant. " + " ".join(f"{t}-rule-{i} applies." for i in range(12))
    for t in ("acme", "globex", "initech")
}


@pytest.fixture(scope="module")
def backends(tiny_llama, server):
    """Three backends alike (ENGINE_KWARGS): two of this module's, then the session's `server`
    (tests/conftest.py). Only this module's are killed (the first, revived in its place)."""
    procs = [ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS)) for _ in range(2)]
    fleet = [*procs, server]
    try:
        for proc in procs:
            proc.start()
        yield fleet
        for proc in fleet:
            metrics = wait_for_idle_pool(proc.url)
            assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0
            assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
    finally:
        for proc in fleet[:len(procs)]:  # the revived one in the killed one's place
            proc.stop()


@pytest.fixture(scope="module")
def router(tiny_llama, backends):
    proc = RouterProcess(tiny_llama, [b.url for b in backends], "--health-interval", "0.3")
    try:
        yield proc.start()
    finally:
        assert proc.stop(), "router did not shut down cleanly"


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), **ENGINE_KWARGS)


def greedy_text(llm: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def complete(url: str, prompt: str, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def sse_payloads(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_models_health_and_metrics(router, backends):
    models = httpx.get(router.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200
    for b in backends:
        assert router_metric(router.url, "pagedkv_router:backend_up", backend=b.url) == 1
        info = httpx.get(b.url + "/kv_cache_info", timeout=10).json()
        assert info["block_size"] == ENGINE_KWARGS["block_size"]
        assert info["num_gpu_blocks"] == ENGINE_KWARGS["num_gpu_blocks_override"]


def test_greedy_outputs_equal_offline(router, offline):
    prompts = ["Hello, my name is", "The capital of France is"]
    expected = greedy_text(offline, prompts, 10)
    for prompt, want in zip(prompts, expected, strict=True):
        assert complete(router.url, prompt, 10).json()["choices"][0]["text"] == want
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        resp = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        payloads = sse_payloads(resp.text)
        assert payloads[-1] == "[DONE]"
        assert "".join(json.loads(p)["choices"][0]["text"] for p in payloads[:-1]) == want
    messages = [{"role": "user", "content": "hi"}]
    want = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].text
    resp = httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0})
    assert resp.json()["choices"][0]["message"]["content"] == want


def test_tenant_requests_go_to_the_backend_holding_its_prompt(router, backends):
    placed: dict[str, set[str]] = {t: set() for t in SYSTEM}
    for round_ in range(3):
        for tenant, system in SYSTEM.items():
            resp = complete(router.url, f"{system} Question {round_}: why?")
            placed[tenant].add(resp.headers[BACKEND_HEADER])
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if round_ > 0:  # the whole system prompt (its full blocks) was a hit
                assert cached >= 4 * 30, (tenant, round_, cached)
    assert all(len(urls) == 1 for urls in placed.values()), placed
    assert len(set().union(*placed.values())) >= 2, placed  # tenants spread


def test_load_spreads_when_one_prefix_is_hot(router, offline):
    prompt = SYSTEM["acme"] + " Hot question?"
    want = greedy_text(offline, [prompt], 48)[0]

    async def one(client: httpx.AsyncClient) -> tuple[str, str]:
        resp = await client.post(router.url + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0.0,
            "ignore_eos": True})
        return resp.headers[BACKEND_HEADER], resp.json()["choices"][0]["text"]

    async def main() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))

    results = asyncio.run(main())
    assert all(text == want for _, text in results)
    counts = {url: sum(1 for u, _ in results if u == url) for url, _ in results}
    assert len(counts) >= 2 and max(counts.values()) <= 8, counts


def test_stream_is_relayed_as_it_comes_and_a_disconnect_aborts_it(router, backends):
    before = {b.url: scrape(b.url)["pagedkv:generation_tokens_total"] for b in backends}
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_raw())  # the first bytes arrive long before the 900th token
        backend = resp.headers[BACKEND_HEADER]
    metrics = wait_for_idle_pool(backend, timeout=20)
    assert metrics["pagedkv:num_requests_running"] == 0
    generated = metrics["pagedkv:generation_tokens_total"] - before[backend]
    assert 0 < generated < 900  # aborted when the client left, not run to the end


MAX_TOKENS_KILLED = 400


def test_a_killed_backend_loses_no_request_that_had_not_started_streaming(
        router, backends, offline, tiny_llama):
    prompts = [f"Request number {i} asks" for i in range(12)]
    # Long enough that none can finish between the router counting two in flight on the victim
    # and the kill (the fused kernels decode the tiny model's 60 tokens in tens of ms).
    expected = greedy_text(offline, prompts, MAX_TOKENS_KILLED)
    victim = backends[0]

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, int, str, list[str]]:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": MAX_TOKENS_KILLED,
                "temperature": 0.0,
                "ignore_eos": True, "stream": i % 3 == 0}
        resp = await client.post(router.url + "/v1/completions", json=body)
        return resp.headers.get(BACKEND_HEADER, ""), resp.status_code, resp.text, \
            sse_payloads(resp.text) if body["stream"] else []

    async def main() -> list[tuple[str, int, str, list[str]]]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(12)]
            while router_metric(router.url, "pagedkv_router:in_flight_requests",
                                backend=victim.url) < 2:
                await asyncio.sleep(0.02)
            victim.proc.send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    cut_streams = 0
    for i, (backend, status, text, payloads) in enumerate(results):
        assert status == 200, text
        if not payloads:  # non-streaming: retried elsewhere if its backend died
            assert json.loads(text)["choices"][0]["text"] == expected[i]
            assert backend != victim.url
            continue
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        if "error" in chunks[-1]:  # was streaming from the victim: an error event ends it
            assert backend == victim.url
            cut_streams += 1
        else:
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected[i]
    assert router_metric(router.url, "pagedkv_router:backend_up", backend=victim.url) == 0
    assert complete(router.url, prompts[0], 6).headers[BACKEND_HEADER] != victim.url
    # The backend comes back on its port and the router takes it back.
    revived = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS))
    revived.port, revived.url = victim.port, victim.url
    victim.proc.wait(timeout=10)
    backends[0] = revived.start()
    deadline = time.monotonic() + 30
    while router_metric(router.url, "pagedkv_router:backend_up", backend=victim.url) != 1:
        assert time.monotonic() < deadline, "the router never marked the revived backend up"
        time.sleep(0.1)
    retried = sum(router_metric(router.url, "pagedkv_router:retries_total",
                                backend=victim.url, reason=reason)
                  for reason in ("connect", "read"))
    assert retried + cut_streams >= 1  # the kill did hit requests in flight
