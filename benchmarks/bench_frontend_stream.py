"""The OpenAI server's frontend CPU per streamed output token, with a stand-in engine core.

The server is the real app (`create_app`: the engine loop thread, output processing,
detokenization, the SSE chunks, uvicorn) over a stand-in core that, every `--step-ms`, gives
each running request one token (random ids of the model's vocabulary; the last one finishes it
with "length"), its step outputs msgpack-encoded and decoded as the core process's are. So the
only CPU the server process spends is the frontend's (the stand-in's own encoding is measured
and left out). A client in this process streams `--requests` completions at once (`--input-len`
prompt token ids, `--output-len` tokens each, as `bench_serve.py`'s load), over raw sockets so
that it costs the two cores little; every stream is checked (its chunks' token count, usage,
[DONE]).

    PYTHONPATH=$PWD python benchmarks/bench_frontend_stream.py [--rounds 3]
        [--baseline OLD_SOURCE_TREE] [--step-ms 20] [--requests 64]

With --baseline (a source tree of the old code, e.g. `git archive <commit> | tar -x -C DIR`)
a second server runs from it and the rounds alternate the two: the printed ratio (median over
rounds) is new / old frontend CPU per token. Figures are CPU time (user + system) of the
server process, from /proc, over each load; Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
READY_TIMEOUT_S = 300.0


class StandInCore:
    """A core client (`InprocCoreClient`'s methods) that decodes one token per running request
    every `step_s` seconds; utility calls go to `real` (an idle in-process core)."""

    def __init__(self, real, step_s: float, vocab: int) -> None:  # noqa: ANN001
        import msgspec

        from pagedkv.engine.messages import Codec

        self.real, self.ready, self.step_s, self.vocab = real, real.ready, step_s, vocab
        self.core = real.core
        self._running: dict[str, list[int]] = {}  # sample id -> [tokens left, next token]
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._next = 0.0
        self._time: float | None = None
        self._codec = Codec()
        self._encoder = msgspec.msgpack.Encoder()
        self.own_cpu_s = 0.0  # the stand-in's encoding (not the frontend's work)

    def add_request(self, request) -> None:  # noqa: ANN001
        with self._lock:
            seed = sum(map(ord, request.request_id)) % self.vocab
            self._running[request.request_id] = [request.sampling_params.max_tokens, seed]

    def abort(self, message) -> None:  # noqa: ANN001
        with self._lock:
            for request_id in message.request_ids:
                self._running.pop(request_id, None)

    def get_outputs(self) -> list:
        from pagedkv.engine.messages import CoreOutput, CoreStepOutputs

        if not self._running:
            self._wake.wait(0.05)
            self._wake.clear()
            return []
        now = time.monotonic()
        if self._next > now:
            time.sleep(self._next - now)
        self._next = max(self._next + self.step_s, time.monotonic())
        started = time.thread_time()
        outputs = []
        with self._lock:
            for request_id, state in list(self._running.items()):
                state[0] -= 1
                state[1] = (state[1] * 1103515245 + 12345) % self.vocab
                done = state[0] <= 0
                outputs.append(CoreOutput(request_id, [state[1]],
                                          finish_reason="length" if done else None))
                if done:
                    del self._running[request_id]
        self._time = time.monotonic()
        data = self._encoder.encode(CoreStepOutputs(outputs, self._time))
        self.own_cpu_s += time.thread_time() - started
        return self._codec.decode_core(data).outputs

    def output_time(self) -> float | None:
        return self._time

    def call(self, method: str, *args):  # noqa: ANN201
        return self.real.call(method, *args)

    def call_async(self, method: str, *args):  # noqa: ANN201
        return self.real.call_async(method, *args)

    def has_pending_calls(self) -> bool:
        return False

    def busy_for(self) -> float:
        return 0.0

    def is_alive(self) -> bool:
        return True

    def wake(self) -> None:
        self._wake.set()

    def shutdown(self) -> None:
        self.real.shutdown()


def process_cpu_s() -> float:
    """This process's user + system CPU seconds."""
    times = os.times()
    return times.user + times.system


def serve(model_dir: str, port: int, step_s: float) -> None:
    """The server process: the real app over a StandInCore, plus GET /bench/cpu."""
    import uvicorn

    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.server.app import create_app
    from pagedkv.testing.random_model import tokenizer_vocab_size
    from pagedkv.utils import freeze_gc_heap

    engine = LLMEngine(EngineArgs(model=model_dir, block_size=32, max_num_seqs=256,
                                  kv_cache_memory_bytes=64 << 20, max_model_len=1024))
    stand_in = engine.client = StandInCore(engine.client, step_s, tokenizer_vocab_size(model_dir))
    app = create_app(engine, served_model_name="m")

    @app.get("/bench/cpu")
    def cpu() -> dict:
        return {"process": process_cpu_s(), "stand_in": stand_in.own_cpu_s}

    freeze_gc_heap()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def _http(port: int, method: str, path: str, body: bytes = b"") -> bytes:
    """One HTTP/1.1 exchange (Connection: close); the raw response, body undecoded."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                 .encode() + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def _dechunk(raw: bytes) -> bytes:
    """The body of a `Transfer-Encoding: chunked` response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"chunked" not in head.lower():
        return rest
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body += rest[:size]
        rest = rest[size + 2:]
    return bytes(body)


def check_stream(raw: bytes, output_len: int) -> int:
    """Every token arrived (usage says `output_len`, one finish, [DONE] last); the number of
    chunks that carried tokens."""
    events = [e for e in _dechunk(raw).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == output_len, usage
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1, finishes[-3:]
    return len(finishes)


async def load(port: int, requests: int, input_len: int, output_len: int, seed: int) -> int:
    """`requests` streamed completions at once; each one's stream checked. The number of
    chunks that carried tokens (fewer than the tokens when a reader fell behind a step)."""
    bodies = [json.dumps({"model": "m", "prompt": [(seed + i * 7 + j) % 500 + 10
                                                   for j in range(input_len)],
                          "max_tokens": output_len, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode()
              for i in range(requests)]
    answers = await asyncio.gather(*(_http(port, "POST", "/v1/completions", b) for b in bodies))
    return sum(check_stream(raw, output_len) for raw in answers)


def cpu_now(port: int) -> tuple[float, float]:
    raw = asyncio.run(_http(port, "GET", "/bench/cpu"))
    figures = json.loads(_dechunk(raw))
    return figures["process"], figures["stand_in"]


def start_server(tree: str, model_dir: str, step_s: float) -> tuple[subprocess.Popen, int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", model_dir, "--port", str(port),
                             "--step-ms", str(step_s * 1000)], env=env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            cpu_now(port)
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server from {tree} did not start") from None
            time.sleep(0.5)


def measure(port: int, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """One load: the frontend's CPU milliseconds per output token, and chunks per token."""
    cpu0, own0 = cpu_now(port)
    chunks = asyncio.run(load(port, args.requests, args.input_len, args.output_len, seed))
    cpu1, own1 = cpu_now(port)
    tokens = args.requests * args.output_len
    return 1000 * ((cpu1 - cpu0) - (own1 - own0)) / tokens, chunks / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default=None, metavar="OLD_SOURCE_TREE")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.step_ms / 1000)
        return
    from pagedkv.testing.random_model import build_random_model_dir

    trees = {"new": str(Path(__file__).resolve().parents[1])}
    if args.baseline:
        trees["old"] = str(Path(args.baseline).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_random_model_dir(Path(tmp) / "m", seed=0, **SHAPE))
        servers = {name: start_server(tree, model_dir, args.step_ms / 1000)
                   for name, tree in trees.items()}
        figures: dict[str, list[float]] = {name: [] for name in trees}
        try:
            for _, port in servers.values():  # warm-up
                measure(port, argparse.Namespace(**{**vars(args), "requests": 8}), 7)
            for r in range(args.rounds):
                for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                    per_token, chunks = measure(servers[name][1], args, 100 + r)
                    figures[name].append(per_token)
                    print(f"  round {r} {name}: frontend {per_token:.4f} ms CPU per output "
                          f"token, {chunks:.2f} chunks per token", flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    for name, runs in figures.items():
        print(f"{name}: frontend CPU per output token {statistics.median(runs):.4f} ms (median; "
              f"{min(runs):.4f}-{max(runs):.4f}) at {args.requests} streams x {args.output_len} "
              f"tokens, a step every {args.step_ms:g} ms")
    if "old" in figures:
        ratio = statistics.median(a / b for a, b in zip(figures["new"], figures["old"], strict=True))
        print(f"new / old: {ratio:.2f}x")


if __name__ == "__main__":
    main()
