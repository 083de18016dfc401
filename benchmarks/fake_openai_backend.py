"""A trivial, instant OpenAI-shaped backend for measuring a router's own overhead.

    python benchmarks/fake_openai_backend.py --port 8001 [--port 8002 ...] [--metrics-file F]

Plain asyncio HTTP/1.1 (keep-alive, Content-Length bodies), one process serving every `--port`:
no framework, so what it costs is a small constant beside the router's. Routes: GET /health
(200), /v1/models, /kv_cache_info (block size 32, sha256: a pagedkv router hashes prompts as for
a `pagedkv serve`), /metrics (the text of `--metrics-file`, e.g. a real server's scrape, else a
few gauges); POST /v1/completions and /v1/chat/completions: a JSON completion, or with
`"stream": true` three SSE data events, a usage event and `data: [DONE]` (chunked), written at
once. Stops on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

MODEL = "bench"
KV_INFO = {"model": MODEL, "block_size": 32, "prefix_caching_hash_algo": "sha256",
           "enable_prefix_caching": True, "num_gpu_blocks": 100_000}
GAUGES = (b"vllm:num_requests_running{engine=\"0\",model_name=\"bench\"} 0.0\n"
          b"vllm:num_requests_waiting{engine=\"0\",model_name=\"bench\"} 0.0\n"
          b"vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"bench\"} 0.0\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _answer(status: str, body: bytes, media: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {media}\r\ncontent-length: {len(body)}\r\n"
            "\r\n").encode() + body


def stream_answer() -> bytes:
    """A whole streamed completion: three text events, usage, [DONE] (chunked encoding)."""
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    events = [json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                          "choices": [{"index": 0, "text": t, "finish_reason": None}]})
              for t in ("a", "b", "c")]
    events.append(json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                              "choices": [], "usage": {"prompt_tokens": 1,
                                                       "completion_tokens": 3,
                                                       "total_tokens": 4}}))
    body = b"".join(_chunk(f"data: {e}\n\n".encode()) for e in events)
    return head + body + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def routes(metrics: bytes) -> dict[tuple[bytes, bytes], bytes]:
    """(method, path) -> the whole answer (a POST's non-streaming one)."""
    completion = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                             "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 3,
                                       "total_tokens": 4}}).encode()
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                     "owned_by": "bench"}]}).encode()
    return {(b"GET", b"/health"): _answer("200 OK", b""),
            (b"GET", b"/v1/models"): _answer("200 OK", models),
            (b"GET", b"/kv_cache_info"): _answer("200 OK", json.dumps(KV_INFO).encode()),
            (b"GET", b"/metrics"): _answer("200 OK", metrics, "text/plain; version=0.0.4"),
            (b"POST", b"/v1/completions"): _answer("200 OK", completion),
            (b"POST", b"/v1/chat/completions"): _answer("200 OK", completion)}


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           table: dict[tuple[bytes, bytes], bytes], streamed: bytes) -> None:
    """Answer requests on one keep-alive connection until the client closes it."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.split(b"\r\n")
            method, target, _ = request_line.split(b" ", 2)
            path = target.split(b"?", 1)[0]
            length = 0
            for line in header_lines:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            answer = table.get((method, path), _answer("404 Not Found", b"{}"))
            if method == b"POST" and b'"stream":true' in body.replace(b" ", b""):
                answer = streamed
            writer.write(answer)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main(ports: list[int], metrics: bytes) -> None:
    table, streamed = routes(metrics), stream_answer()
    servers = [await asyncio.start_server(
        lambda r, w: serve_connection(r, w, table, streamed), "127.0.0.1", port)
        for port in ports]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, action="append", required=True)
    parser.add_argument("--metrics-file", default=None)
    args = parser.parse_args()
    text = open(args.metrics_file, "rb").read() if args.metrics_file else GAUGES  # noqa: SIM115
    asyncio.run(main(args.port, text))
