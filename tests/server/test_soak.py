"""A bounded soak over loopback, in both preemption modes on a tiny KV cache: a fixed number of
mixed streaming and non-streaming requests, n > 1, random client disconnects. Every answered
request is well-formed, the block pool ends empty, and the server's RSS stays bounded."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import ServerProcess, engine_flags, wait_for_idle_pool

NUM_REQUESTS = 72
CONCURRENCY = 12
RSS_GROWTH_BOUND = 150 * 2**20  # after warm-up; a leak of per-request state would pass it


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def one(client: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> str:
    """Send request `i`; returns what happened ('ok' or 'disconnected'), asserting the answer
    is well-formed."""
    n = rng.choice([1, 1, 2, 3])
    max_tokens = rng.randint(4, 24)
    body = {"prompt": f"soak request {i} " + "x " * rng.randint(0, 30), "n": n,
            "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "ignore_eos": True}
    chat = rng.random() < 0.3
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if chat:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    disconnect = rng.random() < 0.25
    if rng.random() < 0.5:  # streaming
        body["stream"] = True
        async with client.stream("POST", url + path, json=body) as resp:
            assert resp.status_code == 200
            events = []
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if disconnect and len(events) >= 2:
                        return "disconnected"  # closing the stream drops the connection
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks
        finished = [ch for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
        assert sorted(ch["index"] for ch in finished) == list(range(n))
        assert all(ch["finish_reason"] == "length" for ch in finished)
        return "ok"
    if disconnect:
        try:
            await client.post(url + path, json=body, timeout=0.05)
        except httpx.TimeoutException:
            return "disconnected"
    resp = await client.post(url + path, json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert [c["index"] for c in data["choices"]] == list(range(n))
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == n * max_tokens
    return "ok"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_soak(tiny_llama, mode):
    flags = engine_flags(dtype="float32", block_size=4, max_model_len=128,
                         num_gpu_blocks_override=40, preemption_mode=mode,
                         swap_space=8 * 2048 / 2**30)
    proc = ServerProcess(tiny_llama, *flags).start()
    try:
        rng = random.Random(mode)

        async def main() -> list[str]:
            limits = httpx.Limits(max_connections=CONCURRENCY)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                gate = asyncio.Semaphore(CONCURRENCY)

                async def bounded(i: int) -> str:
                    async with gate:
                        return await one(client, proc.url, i, rng)

                warm = await asyncio.gather(*(bounded(i) for i in range(CONCURRENCY)))
                results["rss_warm"] = rss_bytes(proc.proc.pid)
                rest = await asyncio.gather(*(bounded(i)
                                              for i in range(CONCURRENCY, NUM_REQUESTS)))
                return [*warm, *rest]

        results: dict[str, int] = {}
        outcomes = asyncio.run(main())
        assert len(outcomes) == NUM_REQUESTS
        assert outcomes.count("ok") >= NUM_REQUESTS // 2
        assert "disconnected" in outcomes
        metrics = wait_for_idle_pool(proc.url)
        assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0
        assert metrics["pagedkv:num_requests_running"] == 0
        assert metrics["pagedkv:num_requests_swapped"] == 0
        assert metrics["pagedkv:num_preemptions_total"] > 0
        if mode == "swap":
            assert metrics["pagedkv:num_swaps_total"] > 0
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
        assert rss_bytes(proc.proc.pid) < results["rss_warm"] + RSS_GROWTH_BOUND
    finally:
        clean = proc.stop()
    assert clean, "server did not shut down cleanly"
