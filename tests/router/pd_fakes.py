"""A fake prefill/decode fleet behind `httpx.MockTransport` for the router's PD tests.

Prefill instances answer a completion by `prefill[host]`: "ok" (a one-token answer carrying
`kv_transfer_params` naming the host), "plain" (no kv_transfer_params: a server without a
producer role), "500", "refuse" (connection refused), "slow" (answers after `slow_s`),
"garbage" (a 200 whose body is not JSON). Decode instances answer with JSON naming the body
they got, or an SSE stream of `STREAM_CHUNKS` when asked to stream. Every completion request is
logged with its JSON body and headers. /tokenize gives a prompt's characters' code points.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

P1, P2 = "http://p1.test", "http://p2.test"
D1, D2 = "http://d1.test", "http://d2.test"
KV_INFO = {"block_size": 4, "prefix_caching_hash_algo": "sha256", "num_gpu_blocks": 64,
           "enable_prefix_caching": True}
STREAM_CHUNKS = (b'data: {"choices":[{"text":"one"}]}\n\n',
                 b'data: {"choices":[{"text":" two"}]}\n\n', b"data: [DONE]\n\n")


class _Chunks(httpx.AsyncByteStream):
    async def __aiter__(self):
        for chunk in STREAM_CHUNKS:
            yield chunk


def producer_params(host: str) -> dict[str, Any]:
    """What the fake producer on `host` answers (vLLM's NIXL connector's shape)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
            "remote_engine_id": f"engine-{host}", "remote_host": host, "remote_port": 5600}


def gauges(running: int = 0, kv_usage: float = 0.0) -> str:
    return ("# TYPE pagedkv:num_requests_running gauge\n"
            f"pagedkv:num_requests_running {running}\n"
            "# TYPE pagedkv:kv_cache_usage_perc gauge\n"
            f"pagedkv:kv_cache_usage_perc {kv_usage}\n")


@dataclass
class Hop:
    host: str
    path: str
    body: Any
    headers: httpx.Headers


@dataclass
class PDFleet:
    prefill: dict[str, str] = field(default_factory=lambda: {P1: "ok", P2: "ok"})
    decode: tuple[str, ...] = (D1, D2)
    metrics: dict[str, str] = field(default_factory=dict)
    slow_s: float = 30.0
    hops: list[Hop] = field(default_factory=list)
    down: set[str] = field(default_factory=set)  # hosts whose /health refuses

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"{request.url.scheme}://{request.url.host}"
        path = request.url.path
        if path == "/health":
            if host in self.down:
                raise httpx.ConnectError("refused")
            return httpx.Response(200)
        if path == "/kv_cache_info":
            return httpx.Response(200, json=KV_INFO)
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics.get(host, gauges()))
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        if path == "/tokenize":
            text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
            return httpx.Response(200, json={"tokens": [ord(c) for c in text]})
        self.hops.append(Hop(host, path, body, request.headers))
        if host in self.prefill:
            return await self._prefill(host, self.prefill[host])
        if isinstance(body, dict) and body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_Chunks())
        return httpx.Response(200, json={"id": "cmpl-d", "served_by": host, "got": body,
                                         "choices": [{"text": "decoded"}]})

    async def _prefill(self, host: str, mode: str) -> httpx.Response:
        if mode == "refuse":
            raise httpx.ConnectError("refused")
        if mode == "500":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if mode == "garbage":
            return httpx.Response(200, text="<html>")
        if mode == "slow":
            await asyncio.sleep(self.slow_s)
        answer = {"id": "cmpl-p", "choices": [{"text": "x"}]}
        if mode != "plain":
            answer["kv_transfer_params"] = producer_params(host)
        return httpx.Response(200, json=answer)

    def posts(self, hosts: set[str] | tuple[str, ...]) -> list[Hop]:
        return [h for h in self.hops if h.host in hosts]
