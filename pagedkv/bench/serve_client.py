"""The load generator of `pagedkv bench serve`: streamed /v1/completions requests sent at
Poisson arrival times, timed per chunk, plus the server's prefix-cache counters before and
after (scraped from /metrics).

Requests ask for `ignore_eos` and greedy sampling so every output is exactly `output_len`
tokens (counted from the stream's final usage chunk).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.datasets import SampleRequest
from pagedkv.bench.metrics import RequestResult

_TIMEOUT_S = 6 * 3600.0
# Ours or vLLM's names (a pagedkv server exports both; a vLLM server only its own).
_COUNTER_RE = re.compile(
    r"^(pagedkv|vllm):prefix_cache_(hits|queries)_total(?:\{[^}]*\})?\s+(\S+)$")


def _httpx() -> Any:
    try:
        import httpx
    except ModuleNotFoundError as exc:  # httpx ships with the dev extras (openai needs it too)
        raise ModuleNotFoundError("pagedkv bench serve needs httpx: pip install httpx") from exc
    return httpx


@dataclass
class ServerInfo:
    model: str
    vocab_size: int | None
    max_model_len: int | None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def get_server_info(client: Any, api_key: str | None = None) -> ServerInfo:
    """The first model of /v1/models, with its vocab_size and max_model_len when given."""
    resp = await client.get("/v1/models", headers=_headers(api_key))
    resp.raise_for_status()
    card = resp.json()["data"][0]
    return ServerInfo(card["id"], card.get("vocab_size"), card.get("max_model_len"))


async def scrape_prefix_cache(client: Any) -> tuple[float, float] | None:
    """(hits, queries) from the server's /metrics (pagedkv's counters, else vLLM's), or None
    when it has no such counters."""
    try:
        resp = await client.get("/metrics")
    except Exception:
        return None
    if resp.status_code != 200:
        return None
    found: dict[tuple[str, str], float] = {}
    for line in resp.text.splitlines():
        match = _COUNTER_RE.match(line.strip())
        if match:
            key = (match.group(1), match.group(2))
            found[key] = found.get(key, 0.0) + float(match.group(3))
    for prefix in ("pagedkv", "vllm"):
        hits, queries = found.get((prefix, "hits")), found.get((prefix, "queries"))
        if hits is not None and queries is not None:
            return hits, queries
    return None


async def send_request(client: Any, model: str, request: SampleRequest,
                       api_key: str | None = None) -> RequestResult:
    """Send one streamed completion and time its chunks (vLLM's async_request_openai_completions)."""
    result = RequestResult(prompt_len=request.prompt_len)
    payload = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
               "temperature": 0.0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    start = last = result.sent = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=payload,
                                 headers=_headers(api_key)) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for data in _sse_data(resp):
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                        result.response_id = chunk.get("id") or ""
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                if chunk.get("usage"):  # its own chunk (vLLM), or on the last one (llama.cpp)
                    usage = chunk["usage"]
                    result.output_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except Exception as exc:  # a failed request is a data point, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = last - start
    if not result.output_tokens:  # a server that reports no usage: a chunk a token
        result.output_tokens = chunks
    result.success = result.ttft > 0.0
    if not result.success:
        result.error = "no chunk received"
    return result


async def _sse_data(resp: Any) -> AsyncIterator[str]:
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield data


async def arrivals(num: int, request_rate: float, seed: int) -> AsyncIterator[int]:
    """Yield 0..num-1 at Poisson arrival times of `request_rate` per second (inf: at once)."""
    rng = random.Random(seed)
    for i in range(num):
        yield i
        if request_rate != float("inf") and i + 1 < num:
            await asyncio.sleep(rng.expovariate(request_rate))


async def run_load(url: str, requests: list[SampleRequest], *, model: str, request_rate: float,
                   seed: int = 0, api_key: str | None = None, max_concurrency: int | None = None,
                   progress: bool = True) -> tuple[list[RequestResult], float,
                                                    tuple[float, float] | None]:
    """Send every request; returns (results in request order, wall time, prefix-cache
    (hits, queries) delta over the run or None)."""
    httpx = _httpx()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=_TIMEOUT_S, limits=limits) as client:
        before = await scrape_prefix_cache(client)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="requests", dynamic_ncols=True)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(request: SampleRequest) -> RequestResult:
            if gate is None:
                result = await send_request(client, model, request, api_key)
            else:
                async with gate:
                    result = await send_request(client, model, request, api_key)
            if bar is not None:
                bar.update(1)
            return result

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(requests[i]))
                 async for i in arrivals(len(requests), request_rate, seed)]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        after = await scrape_prefix_cache(client)
    delta = None
    if before is not None and after is not None:
        delta = (after[0] - before[0], after[1] - before[1])
    return results, duration, delta
