"""Router policies on a multi-tenant workload: three `pagedkv serve` backends, one run each of
round-robin (the baseline), least-load and kv-aware, the same requests at the same Poisson
arrival times.

    PYTHONPATH=. python benchmarks/bench_router.py [--tenants 16] [--system-tokens 1000] \\
        [--requests 96] [--rate 3] [--blocks 448] [--json]

Workload: `--tenants` tenants, each with its own random `--system-tokens`-token system prompt;
every request is one tenant's prompt (chosen uniformly) plus a short random question
(`--question-tokens`), answering `--output-tokens` tokens. Backends: a random-weight Llama
(hidden 256, 4 layers; `--hidden`, `--layers`), block size 16, and a KV cache of `--blocks`
blocks each: room for about a third of the tenants' prompts, so where a request goes decides
whether its prompt is cached. Each policy gets fresh system prompts (another seed), so no run
starts with the previous run's cache. Per policy: prefix-cache hit rate (cached / prompt tokens,
as the backends report them), TTFT and E2E mean and p99, request throughput, requests per
backend and max/mean of those; then each figure's ratio to round-robin. The machine's other
load makes absolute times noisy; compare ratios within one run.

`--vs-vllm-router`: our kv-aware router against vLLM's `vllm-router` (cache_aware, kv_aware) on
the Mooncake conversation trace instead (router_vs_vllm_router.py says how).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from router_vs_vllm_router import add_arguments  # noqa: E402
from router_vs_vllm_router import main as vs_vllm_router  # noqa: E402

from pagedkv.bench.datasets import FIRST_TOKEN_ID, SampleRequest  # noqa: E402
from pagedkv.bench.metrics import compute_metrics  # noqa: E402
from pagedkv.bench.serve_client import run_load  # noqa: E402
from pagedkv.testing import build_random_model_dir  # noqa: E402
from tests.router.helpers import RouterProcess, router_metric  # noqa: E402
from tests.server.helpers import ServerProcess  # noqa: E402

POLICIES = ("round-robin", "least-load", "kv-aware")
BLOCK_SIZE = 16


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[SampleRequest]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]

    systems = [tokens(args.system_tokens) for _ in range(args.tenants)]
    return [SampleRequest(systems[rng.randrange(args.tenants)] + tokens(args.question_tokens),
                          args.output_tokens) for _ in range(args.requests)]


def run_policy(policy: str, model_dir: Path, backends: list[str],
               requests: list[SampleRequest], args: argparse.Namespace) -> dict:
    router = RouterProcess(model_dir, backends, "--policy", policy,
                           "--health-interval", "0.25").start()
    try:
        results, duration, _ = asyncio.run(run_load(
            router.url, requests, model="bench", request_rate=args.rate, seed=args.seed,
            progress=False))
        per_backend = [int(router_metric(router.url, "pagedkv_router:requests_total",
                                         backend=b, status="200")) for b in backends]
    finally:
        router.stop()
    m = compute_metrics(results, duration)
    ok = [r for r in results if r.success]
    mean = sum(per_backend) / len(per_backend)
    return {
        "policy": policy, "completed": m["completed"], "failed": m["failed"],
        "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_len for r in ok)),
        "ttft_mean_ms": m["ttft_ms"]["mean"], "ttft_p99_ms": m["ttft_ms"]["p99"],
        "e2e_mean_ms": m["e2el_ms"]["mean"], "e2e_p99_ms": m["e2el_ms"]["p99"],
        "throughput_rps": m["request_throughput"], "requests_per_backend": per_backend,
        "max_over_mean_load": max(per_backend) / mean if mean else 0.0,
        "errors": m["errors"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=3.0, help="Poisson arrivals per second")
    p.add_argument("--blocks", type=int, default=448, help="KV blocks per backend")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG: hit rate and latency per policy (matplotlib)")
    add_arguments(p)
    args = p.parse_args()
    if args.vs_vllm_router:
        return vs_vllm_router(args)
    os.environ["OMP_NUM_THREADS"] = "1"  # three backends share the machine's cores
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp_name:
        model_dir = build_random_model_dir(
            Path(tmp_name) / "model", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_layers=args.layers, num_heads=4, num_kv_heads=2, max_position_embeddings=4096)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        flags = ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(args.blocks),
                 "--max-model-len", "2048", "--dtype", "float32"]
        procs = [ServerProcess(model_dir, *flags, model_name="bench") for _ in range(3)]
        try:
            for proc in procs:
                proc.start()
            rows = [run_policy(policy, model_dir, [p.url for p in procs],
                               workload(args, vocab, seed=args.seed + 1000 * (k + 1)), args)
                    for k, policy in enumerate(POLICIES)]
        finally:
            for proc in procs:
                proc.stop()
    base = rows[0]
    for row in rows:
        row["vs_round_robin"] = {
            key: row[key] / base[key] if base[key] else None
            for key in ("hit_rate", "ttft_mean_ms", "ttft_p99_ms", "e2e_mean_ms", "e2e_p99_ms",
                        "throughput_rps")}
    if args.plot:
        from pagedkv.bench.plot import bar_chart

        bar_chart(args.plot, "router policies: latency (ms)", [r["policy"] for r in rows],
                  {"TTFT mean": [r["ttft_mean_ms"] for r in rows],
                   "TTFT p99": [r["ttft_p99_ms"] for r in rows],
                   "E2E mean": [r["e2e_mean_ms"] for r in rows]}, ylabel="ms")
        bar_chart(args.plot.replace(".png", "") + "-hit-rate.png",
                  "router policies: prefix-cache hit rate", [r["policy"] for r in rows],
                  {"hit rate": [r["hit_rate"] for r in rows]}, ylabel="hit rate")
    if args.json:
        print(json.dumps({"args": vars(args), "results": rows}, indent=2))
        return 0
    print(f"{args.requests} requests/policy, {args.tenants} tenants x {args.system_tokens}-token "
          f"system prompts, {args.rate}/s Poisson, 3 backends x {args.blocks} blocks of "
          f"{BLOCK_SIZE}")
    print(f"{'policy':<12} {'hit':>6} {'TTFT mean':>10} {'p99':>8} {'E2E mean':>9} {'p99':>8} "
          f"{'req/s':>6}  per backend   max/mean  (ratios vs round-robin: hit, TTFT, E2E)")
    for r in rows:
        v = r["vs_round_robin"]
        print(f"{r['policy']:<12} {r['hit_rate']:>6.1%} {r['ttft_mean_ms']:>8.0f}ms "
              f"{r['ttft_p99_ms']:>6.0f}ms {r['e2e_mean_ms']:>7.0f}ms {r['e2e_p99_ms']:>6.0f}ms "
              f"{r['throughput_rps']:>6.2f}  {str(r['requests_per_backend']):<13} "
              f"{r['max_over_mean_load']:>5.2f}    x{v['hit_rate'] or 0:.2f} "
              f"x{v['ttft_mean_ms']:.2f} x{v['e2e_mean_ms']:.2f}")
    for r in rows:
        if r["errors"]:
            print(f"{r['policy']}: {r['failed']} failed: {r['errors']}")
    failed = sum(r["failed"] for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
