"""`bench_router.py --vs-vllm-router`: our kv-aware router against vLLM's Rust router
(`vllm-router`, from the registry, in a throwaway venv: never a project dependency), no shim.

    python -m venv /tmp/vllm-router-venv && /tmp/vllm-router-venv/bin/pip install vllm-router
    PYTHONPATH=. python benchmarks/bench_router.py --vs-vllm-router \\
        [--vllm-router /tmp/vllm-router-venv/bin/vllm-router] [--requests 400] [--rate 12]

Workload: `--requests` rows of the Mooncake conversation trace
(../shared/traces/mooncake_conversation_trace.jsonl): among its first `--window` rows, the
conversations with the most turns (a conversation: the rows sharing their first two block ids,
the trace's common first block and the conversation's own), in trace order (the first 400 rows
alone share little: an unbounded cache would hit 14% of their tokens). Each 512-token block id
is expanded into a
deterministic run of tokens (`pagedkv.sim.traces.prompt_token_ids`, as the traces' README says),
lengths scaled by `--scale` (default 1/16: blocks of 32 tokens, the backends' block size; mean
input ~890 tokens), prompts cut to `--max-prompt` tokens, outputs capped at `--max-output`.
The ideal hit rate (an unbounded cache) is printed with the results. Arrivals: Poisson
`--rate` per second, the same seed for every router. Backends: `--backends` (3) fresh
`pagedkv serve` instances per run (empty caches), random Llama, `--router-blocks` KV blocks
each, KV events published in vLLM's format on `tcp://*:<port>`. By default they share every
CPU of the machine (on a 2-core box, three backends contend for two cores: a router that
spreads requests pays for that, one that piles them on one backend does not); `--pin` is the
fleet model instead: each backend alone on its own share of the CPUs (`taskset`,
`--cpu-threads` = its cores), as instances of a real fleet are. Routers, one run each:
- ours: `pagedkv router --policy kv-aware` with the backends' events;
- vllm-router `--policy cache_aware` (its approximate radix tree of routed prompts);
- vllm-router `--policy kv_aware --kv-event-source URL=tcp://127.0.0.1:<port>` per backend
  (reads our events directly; `VLLM_ROUTER_TOKENIZER` names the model directory).
vllm-router adds its own fields to every request (`no_stop_trim`, ...): `pagedkv serve`
accepts them with a warning, so no shim sits in between. Prints, per router: hit rate (cached /
prompt tokens, as the backends report them), mean and p99 TTFT, requests per backend (from each
backend's vllm:request_success_total), failures, the router's CPU seconds; then where TTFT
went (pagedkv/bench/placement.py, from the backends' request logs): per backend, the slowest
5%, and TTFT with nothing queued on the request's backend, with and without prefills on the
others (contention), against work queued ahead (placement). `--dump DIR` keeps the records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.bench.datasets import SampleRequest, shared_trace
from pagedkv.bench.machine import cpu_name
from pagedkv.bench.metrics import compute_metrics
from pagedkv.bench.placement import join_records, read_request_log, summarize, write_records
from pagedkv.bench.serve_client import run_load
from pagedkv.router.prompt import PromptHasher
from pagedkv.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    load_trace,
    prompt_token_ids,
)
from pagedkv.testing import build_random_model_dir
from tests.router.helpers import RouterProcess
from tests.server.helpers import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]
TRACE = shared_trace("mooncake_conversation_trace.jsonl")
BLOCK_SIZE = 32
MODEL = "bench"
OURS = "pagedkv kv-aware"
ROUTERS = (OURS, "vllm-router cache_aware", "vllm-router kv_aware")


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
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help="which routers to run, in this order (comma-separated); ours may "
                        "carry its flags, e.g. 'pagedkv kv-aware --eviction-weight 0'")
    p.add_argument("--window", type=int, default=2000,
                   help="the trace rows the conversations are chosen from")
    p.add_argument("--backends", type=int, default=3, help="backends per run in this mode")
    p.add_argument("--pin", action="store_true",
                   help="a fleet model: each backend on its own share of the CPUs (taskset, "
                        "--cpu-threads = its cores), no two backends on one core")
    p.add_argument("--dump", default=None, metavar="DIR",
                   help="write each router's per-request records (placement.py) to DIR")


def busiest_conversations(rows: list[TraceRequest], count: int) -> list[TraceRequest]:
    """The rows of the conversations with the most turns (keyed by their first two block ids),
    the busiest first, until `count` rows; returned in trace order."""
    turns = Counter(r.block_ids[:2] for r in rows)
    keep: set[tuple[int, ...]] = set()
    taken = 0
    for conversation, n in turns.most_common():
        if taken >= count:
            break
        keep.add(conversation)
        taken += n
    return [r for r in rows if r.block_ids[:2] in keep][:count]


def ideal_hit_rate(requests: list[SampleRequest]) -> float:
    """Prompt tokens in full blocks an unbounded prefix cache would already hold."""
    seen: set[bytes] = set()
    hits = 0
    hasher = PromptHasher(None, block_size=BLOCK_SIZE, hash_algo="sha256")
    for request in requests:
        for block_hash in hasher.block_hashes(request.prompt_token_ids, None):
            hits += BLOCK_SIZE if block_hash in seen else 0
            seen.add(block_hash)
    return hits / max(1, sum(r.prompt_len for r in requests))


def trace_workload(args: argparse.Namespace, vocab: int) -> list[SampleRequest]:
    """`args.requests` rows of the trace as token-id prompts (see the module docstring)."""
    rows = load_trace(args.trace, "mooncake", scale_lengths=args.scale, limit=args.window)
    rows = busiest_conversations(rows, args.requests)
    return [SampleRequest(prompt_token_ids(r, vocab, i)[:args.max_prompt],
                          min(r.output_length, args.max_output)) for i, r in enumerate(rows)]


def requests_served(url: str) -> int:
    """Requests a backend finished (its vllm:request_success_total, every finish reason)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return int(sum(s.value for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name == "vllm:request_success_total"))


class VllmRouterProcess(ServerProcess):
    """A `vllm-router` subprocess on a free loopback port (started and stopped as a server:
    up once its /health answers 200)."""

    def __init__(self, executable: str, backends: list[str], *flags: str) -> None:
        super().__init__(Path(executable), *flags, model_name=None)
        self.backends = backends
        self.metrics_url = f"http://127.0.0.1:{free_port()}"

    def command(self) -> list[str]:
        return [str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *self.backends, "--log-level", "warning",
                "--prometheus-host", "127.0.0.1",
                "--prometheus-port", self.metrics_url.rsplit(":", 1)[1], *self.args]

    def kv_lookups(self) -> dict[str, float]:
        """Its kv_aware counters (vllm_router_kv_*), summed per name and label set: did it
        find our events' blocks?"""
        text = httpx.get(self.metrics_url + "/metrics", timeout=10).text
        return {f"{s.name}{sorted(s.labels.items())}": s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("vllm_router_kv_")}


class PinnedServerProcess(ServerProcess):
    """A `pagedkv serve` started under `taskset -c CPUS` (its engine core inherits them)."""

    def __init__(self, cpus: list[int], model_dir: Path, *args: str, model_name: str) -> None:
        super().__init__(model_dir, *args, "--cpu-threads", str(len(cpus)),
                         model_name=model_name)
        self.cpus = cpus

    def command(self) -> list[str]:
        return ["taskset", "-c", ",".join(map(str, self.cpus)), *super().command()]


def cpu_shares(num_backends: int) -> list[list[int]]:
    """The allowed CPUs split into `num_backends` disjoint, contiguous, near-equal shares."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 < num_backends <= len(cpus):
        raise ValueError(f"--pin: {num_backends} backends need as many CPUs; this process "
                         f"may use {len(cpus)}")
    return [cpus[i * len(cpus) // num_backends:(i + 1) * len(cpus) // num_backends]
            for i in range(num_backends)]


def start_backends(model_dir: Path, args: argparse.Namespace,
                   logs: list[Path]) -> tuple[list[ServerProcess], list[int]]:
    """`args.backends` fresh `pagedkv serve` backends publishing KV events, each logging its
    requests to `logs[i]`; (processes, event ports)."""
    ports = [free_port() for _ in range(args.backends)]
    flags = ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override",
             str(args.router_blocks), "--max-model-len", str(args.max_prompt + args.max_output),
             "--dtype", "float32"]
    shares = cpu_shares(args.backends) if args.pin else [None] * args.backends

    def backend(port: int, log: Path, cpus: list[int] | None) -> ServerProcess:
        own = [*flags, "--request-log", str(log), "--kv-events-config", json.dumps(
            {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})]
        if cpus is None:
            return ServerProcess(model_dir, *own, model_name=MODEL)
        return PinnedServerProcess(cpus, model_dir, *own, model_name=MODEL)

    procs = [backend(*spec) for spec in zip(ports, logs, shares, strict=True)]
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
    if which.startswith(OURS):
        flags = [f for ep in events for f in ("--kv-events", ep)]
        # Both routers at their default health interval (ours 1 s: /health, /kv_cache_info,
        # /v1/models and the load gauges; vllm-router's one /health per 60 s); our first-byte
        # timeout as long as vllm-router's wait.
        return RouterProcess(model_dir, urls, "--policy", "kv-aware", *flags,
                             "--first-byte-timeout", "1800", *which[len(OURS):].split()).start()
    os.environ["VLLM_ROUTER_TOKENIZER"] = str(model_dir)  # vllm-router's tokenizer
    if which == "vllm-router cache_aware":
        return VllmRouterProcess(args.vllm_router, urls, "--policy", "cache_aware").start()
    sources = [f for url, ep in zip(urls, events, strict=True)
               for f in ("--kv-event-source", f"{url}={ep}")]
    return VllmRouterProcess(args.vllm_router, urls, "--policy", "kv_aware", *sources,
                             "--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model",
                             MODEL).start()


def run_one(which: str, model_dir: Path, requests: list[SampleRequest],
            args: argparse.Namespace, tmp: Path) -> dict:
    """One router in front of fresh backends, the whole workload; its figures and per-request
    records (placement.py)."""
    slug = "".join(ch if ch.isalnum() or ch in "._" else "-" for ch in which)
    logs = [tmp / f"{slug}-backend{i}.jsonl" for i in range(args.backends)]
    procs, ports = start_backends(model_dir, args, logs)
    router = None
    try:
        urls = [p.url for p in procs]
        router = start_router(which, model_dir, urls, ports, args)
        time.sleep(1.0)  # event subscriptions settle (ZMQ's slow joiner)
        results, duration, _ = asyncio.run(run_load(
            router.url, requests, model=MODEL, request_rate=args.rate, seed=args.seed,
            progress=False))
        per_backend = [requests_served(u) for u in urls]
        kv_lookups = router.kv_lookups() if isinstance(router, VllmRouterProcess) else {}
        router_cpu_s = process_cpu_seconds(router.proc.pid)
    finally:
        if router is not None:
            router.stop()
        for proc in procs:
            proc.stop()
    m = compute_metrics(results, duration)
    ok = [r for r in results if r.success]
    records = join_records(results, [read_request_log(log) for log in logs])
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
        write_records(Path(args.dump) / f"{slug}.jsonl", records)
    return {"router": which, "completed": m["completed"], "failed": m["failed"],
            "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_len for r in ok)),
            "ttft_mean_ms": m["ttft_ms"]["mean"], "ttft_p99_ms": m["ttft_ms"]["p99"],
            "requests_per_backend": per_backend, "errors": m["errors"],
            "router_cpu_s": router_cpu_s, "placement": summarize(records, args.backends),
            "vllm_router_kv_metrics": kv_lookups}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(args: argparse.Namespace) -> int:
    if not Path(args.vllm_router).is_file():
        raise SystemExit(f"no vllm-router at {args.vllm_router}: install it into a throwaway "
                         "venv (see this script's docstring)")
    os.environ["OMP_NUM_THREADS"] = "1"  # three backends share the machine's cores
    routers = [r.strip() for r in args.routers.split(",")]
    unknown = sorted(r for r in routers if r not in ROUTERS and not r.startswith(OURS + " --"))
    if unknown:
        raise ValueError(f"--routers: unknown {unknown}; choose from {list(ROUTERS)}")
    with tempfile.TemporaryDirectory(prefix="bench-router-vs-") as tmp:
        model_dir = build_random_model_dir(
            Path(tmp) / "model", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_layers=args.layers, num_heads=4, num_kv_heads=2,
            max_position_embeddings=args.max_prompt + args.max_output)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        requests = trace_workload(args, vocab)
        ideal = ideal_hit_rate(requests)
        rows = [run_one(which, model_dir, requests, args, Path(tmp)) for which in routers]
    if args.json:
        print(json.dumps({"args": vars(args), "cpu": cpu_name(), "ideal_hit_rate": ideal,
                          "results": rows}, indent=2))
        return 0
    mean_in = sum(r.prompt_len for r in requests) / len(requests)
    fleet = (f"pinned: {cpu_shares(args.backends)} CPUs each" if args.pin
             else "sharing every CPU")
    print(f"{len(requests)} Mooncake conversation requests (busiest conversations of the first "
          f"{args.window} rows; lengths x{args.scale:g}, mean prompt {mean_in:.0f} tokens, cut "
          f"at {args.max_prompt}, outputs <= {args.max_output}), Poisson {args.rate}/s, "
          f"{args.backends} backends x {args.router_blocks} blocks of {BLOCK_SIZE} ({fleet}), "
          f"model hidden {args.hidden} x {args.layers} layers; CPU: {cpu_name()}")
    print(f"ideal hit rate (unbounded cache): {ideal:.1%}")
    print(f"{'router':<24} {'hit':>6} {'TTFT mean':>10} {'p99':>8}  per backend   failed  "
          f"router CPU s")
    for r in rows:
        print(f"{r['router']:<24} {r['hit_rate']:>6.1%} {r['ttft_mean_ms']:>8.0f}ms "
              f"{r['ttft_p99_ms']:>6.0f}ms  {str(r['requests_per_backend']):<13} {r['failed']:>6}"
              f"  {r['router_cpu_s']:.1f}")
    for r in rows:
        print(f"{r['router']}: where TTFT goes (server-side):", *r["placement"], sep="\n")
    for r in rows:
        if r["errors"]:
            print(f"{r['router']}: {r['failed']} failed: {r['errors']}")
        if r["vllm_router_kv_metrics"]:
            print(f"{r['router']}: {r['vllm_router_kv_metrics']}")
    return 1 if any(r["failed"] for r in rows) else 0
