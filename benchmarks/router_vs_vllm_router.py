"""`bench_router.py --vs-vllm-router`: our kv-aware router against vLLM's Rust router
(`vllm-router`, from the registry, in a throwaway venv: never a project dependency), no shim.

    python -m venv /tmp/vllm-router-venv && /tmp/vllm-router-venv/bin/pip install vllm-router
    PYTHONPATH=. python benchmarks/bench_router.py --vs-vllm-router \\
        [--vllm-router /tmp/vllm-router-venv/bin/vllm-router] [--requests 400] [--rate 12]

Workload: the first `--requests` rows of the Mooncake conversation trace
(../shared/traces/mooncake_conversation_trace.jsonl), each 512-token block id expanded into a
deterministic run of tokens (`pagedkv.sim.traces.prompt_token_ids`, as the traces' README says),
lengths scaled by `--scale` (default 1/16: blocks of 32 tokens, the backends' block size; mean
input ~890 tokens), prompts cut to `--max-prompt` tokens, outputs capped at `--max-output`.
Arrivals: Poisson `--rate` per second, the same seed for every router. Backends: three fresh
`pagedkv serve` instances per run (empty caches), random Llama, `--blocks` KV blocks each, KV
events published in vLLM's format on `tcp://*:<port>`. Routers, one run each:
- ours: `pagedkv router --policy kv-aware` with the backends' events;
- vllm-router `--policy cache_aware` (its approximate radix tree of routed prompts);
- vllm-router `--policy kv_aware --kv-event-source URL=tcp://127.0.0.1:<port>` per backend
  (reads our events directly; `VLLM_ROUTER_TOKENIZER` names the model directory).
vllm-router adds its own fields to every request (`no_stop_trim`, ...): `pagedkv serve`
accepts them with a warning, so no shim sits in between. Prints, per router: hit rate (cached /
prompt tokens, as the backends report them), mean and p99 TTFT, requests per backend (from each
backend's vllm:request_success_total), failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.bench.datasets import SampleRequest
from pagedkv.bench.machine import cpu_name
from pagedkv.bench.metrics import compute_metrics
from pagedkv.bench.serve_client import run_load
from pagedkv.sim.traces import MOONCAKE_BLOCK_TOKENS, load_trace, prompt_token_ids
from pagedkv.testing import build_random_model_dir
from tests.router.helpers import RouterProcess
from tests.server.helpers import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK_SIZE = 32
MODEL = "bench"
STARTUP_S = 120.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of this mode (bench_router.py's parser)."""
    p.add_argument("--vs-vllm-router", action="store_true", help=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-router", default="/tmp/vllm-router-venv/bin/vllm-router",
                   help="the vllm-router executable (a throwaway venv's)")
    p.add_argument("--trace", default=str(TRACE), help="a Mooncake conversation trace")
    p.add_argument("--scale", type=float, default=BLOCK_SIZE / MOONCAKE_BLOCK_TOKENS,
                   help="length scale of the trace (default 1/16: 512-token blocks -> 32)")
    p.add_argument("--max-prompt", type=int, default=3072, help="prompts cut to this many tokens")
    p.add_argument("--max-output", type=int, default=32, help="outputs capped at this")
    p.add_argument("--router-blocks", type=int, default=800,
                   help="KV blocks per backend in this mode")


def trace_workload(args: argparse.Namespace, vocab: int) -> list[SampleRequest]:
    """The trace's first `args.requests` rows as token-id prompts (see the module docstring)."""
    rows = load_trace(args.trace, "mooncake", scale_lengths=args.scale, limit=args.requests)
    return [SampleRequest(prompt_token_ids(r, vocab, i)[:args.max_prompt],
                          min(r.output_length, args.max_output)) for i, r in enumerate(rows)]


def requests_served(url: str) -> int:
    """Requests a backend finished (its vllm:request_success_total, every finish reason)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return int(sum(s.value for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name == "vllm:request_success_total"))


class VllmRouterProcess:
    """A `vllm-router` subprocess on a free loopback port."""

    def __init__(self, executable: str, backends: list[str], *flags: str,
                 env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, log_path = tempfile.mkstemp(prefix="vllm-router-", suffix=".log")
        self.log_path = Path(log_path)
        self.cmd = [executable, "--host", "127.0.0.1", "--port", str(self.port),
                    "--worker-urls", *backends, "--log-level", "warning", *flags]
        with os.fdopen(fd, "wb") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **env})

    def wait_ready(self) -> VllmRouterProcess:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"vllm-router not ready in {STARTUP_S} s: {self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_backends(model_dir: Path, args: argparse.Namespace) -> tuple[list[ServerProcess],
                                                                       list[int]]:
    """Three fresh `pagedkv serve` backends publishing KV events; (processes, event ports)."""
    ports = [free_port() for _ in range(3)]
    flags = ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override",
             str(args.router_blocks), "--max-model-len", str(args.max_prompt + args.max_output),
             "--dtype", "float32"]
    procs = [ServerProcess(model_dir, *flags, "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}), model_name=MODEL)
        for port in ports]
    try:
        for proc in procs:
            proc.start()
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs, ports


def start_router(which: str, model_dir: Path, urls: list[str], ports: list[int],
                 args: argparse.Namespace) -> RouterProcess | VllmRouterProcess:
    events = [f"tcp://127.0.0.1:{port}" for port in ports]
    if which == "pagedkv kv-aware":
        flags = [f for ep in events for f in ("--kv-events", ep)]
        return RouterProcess(model_dir, urls, "--policy", "kv-aware", *flags,
                             "--health-interval", "0.25").start()
    env = {"VLLM_ROUTER_TOKENIZER": str(model_dir)}
    if which == "vllm-router cache_aware":
        return VllmRouterProcess(args.vllm_router, urls, "--policy", "cache_aware",
                                 env=env).wait_ready()
    sources = [f for url, ep in zip(urls, events, strict=True) for f in ("--kv-event-source", f"{url}={ep}")]
    return VllmRouterProcess(args.vllm_router, urls, "--policy", "kv_aware", *sources,
                             "--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL,
                             env=env).wait_ready()


def run_one(which: str, model_dir: Path, requests: list[SampleRequest],
            args: argparse.Namespace) -> dict:
    """One router in front of three fresh backends, the whole workload; its figures."""
    procs, ports = start_backends(model_dir, args)
    router = None
    try:
        urls = [p.url for p in procs]
        router = start_router(which, model_dir, urls, ports, args)
        time.sleep(1.0)  # event subscriptions settle (ZMQ's slow joiner)
        results, duration, _ = asyncio.run(run_load(
            router.url, requests, model=MODEL, request_rate=args.rate, seed=args.seed,
            progress=False))
        per_backend = [requests_served(u) for u in urls]
    finally:
        if router is not None:
            router.stop()
        for proc in procs:
            proc.stop()
    m = compute_metrics(results, duration)
    ok = [r for r in results if r.success]
    return {"router": which, "completed": m["completed"], "failed": m["failed"],
            "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_len for r in ok)),
            "ttft_mean_ms": m["ttft_ms"]["mean"], "ttft_p99_ms": m["ttft_ms"]["p99"],
            "requests_per_backend": per_backend, "errors": m["errors"]}


def main(args: argparse.Namespace) -> int:
    if not Path(args.vllm_router).is_file():
        raise SystemExit(f"no vllm-router at {args.vllm_router}: install it into a throwaway "
                         "venv (see this script's docstring)")
    os.environ["OMP_NUM_THREADS"] = "1"  # three backends share the machine's cores
    routers = ("pagedkv kv-aware", "vllm-router cache_aware", "vllm-router kv_aware")
    with tempfile.TemporaryDirectory(prefix="bench-router-vs-") as tmp:
        model_dir = build_random_model_dir(
            Path(tmp) / "model", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_layers=args.layers, num_heads=4, num_kv_heads=2,
            max_position_embeddings=args.max_prompt + args.max_output)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        requests = trace_workload(args, vocab)
        rows = [run_one(which, model_dir, requests, args) for which in routers]
    if args.json:
        print(json.dumps({"args": vars(args), "cpu": cpu_name(), "results": rows}, indent=2))
        return 0
    mean_in = sum(r.prompt_len for r in requests) / len(requests)
    print(f"{len(requests)} Mooncake conversation requests (lengths x{args.scale:g}, mean prompt "
          f"{mean_in:.0f} tokens, cut at {args.max_prompt}, outputs <= {args.max_output}), "
          f"Poisson {args.rate}/s, 3 backends x {args.router_blocks} blocks of {BLOCK_SIZE}; "
          f"CPU: {cpu_name()}")
    print(f"{'router':<24} {'hit':>6} {'TTFT mean':>10} {'p99':>8}  per backend   failed")
    for r in rows:
        print(f"{r['router']:<24} {r['hit_rate']:>6.1%} {r['ttft_mean_ms']:>8.0f}ms "
              f"{r['ttft_p99_ms']:>6.0f}ms  {str(r['requests_per_backend']):<13} {r['failed']}")
    for r in rows:
        if r["errors"]:
            print(f"{r['router']}: {r['failed']} failed: {r['errors']}")
    return 1 if any(r["failed"] for r in rows) else 0
