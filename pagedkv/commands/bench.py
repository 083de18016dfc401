"""`pagedkv bench serve`: load an OpenAI-compatible server and report vLLM's serving metrics.

    pagedkv bench serve --url http://127.0.0.1:8000 --dataset random|shared-prefix
                        --num-prompts N --request-rate R [--input-len 256] [--output-len 64]
                        [--prefix-len 512] [--seed 0] [--max-concurrency C] [--json]

Prompts are random token ids (see pagedkv.bench.datasets), sent as streamed /v1/completions
with ignore_eos at Poisson arrival times (`--request-rate inf` sends them all at once). Reports
TTFT, TPOT, ITL and end-to-end latency (mean, median, p99), request and token throughput, and
the server's prefix-cache hit rate over the run (from its /metrics), as a table or `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from pagedkv.bench.datasets import DATASETS

DEFAULT_VOCAB_SIZE = 1000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` (with its `serve` subcommand) on an argparse subparsers object."""
    parser = subparsers.add_parser("bench", help="benchmarks (serve: load a running server)",
                                   description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="bench_command", metavar="{serve}", required=True)
    serve = sub.add_parser("serve", help="serving benchmark against a running server",
                           description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    serve.add_argument("--model", default=None, help="model name (default: the server's first)")
    serve.add_argument("--api-key", default=None, help="Bearer token, if the server needs one")
    serve.add_argument("--dataset", choices=DATASETS, default="random")
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--request-rate", type=float, default=float("inf"),
                       help="requests per second, Poisson arrivals (inf: all at once)")
    serve.add_argument("--max-concurrency", type=int, default=None,
                       help="most requests in flight (default: no limit)")
    serve.add_argument("--input-len", type=int, default=256,
                       help="prompt tokens (after the shared prefix, for shared-prefix)")
    serve.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    serve.add_argument("--prefix-len", type=int, default=512,
                       help="shared prefix tokens (shared-prefix only)")
    serve.add_argument("--range-ratio", type=float, default=0.0,
                       help="spread prompt lengths uniformly over input_len * (1 +- ratio)")
    serve.add_argument("--vocab-size", type=int, default=None,
                       help="token ids are drawn below this (default: the server's vocab_size)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--json", action="store_true", help="print the figures as JSON")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar")
    serve.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        return asyncio.run(_serve(args))
    raise ValueError(f"unknown bench command {args.bench_command!r}")


async def _serve(args: argparse.Namespace) -> int:
    from pagedkv.bench.datasets import sample_requests
    from pagedkv.bench.metrics import compute_metrics, format_table
    from pagedkv.bench.serve_client import _httpx, get_server_info, run_load

    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    httpx = _httpx()
    try:
        async with httpx.AsyncClient(base_url=args.url, timeout=30.0) as client:
            info = await get_server_info(client, args.api_key)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"cannot query {args.url}/v1/models: {exc}") from exc
    vocab_size = args.vocab_size or info.vocab_size or DEFAULT_VOCAB_SIZE
    requests = sample_requests(
        args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, vocab_size=vocab_size,
        prefix_len=args.prefix_len if args.dataset == "shared-prefix" else 0,
        range_ratio=args.range_ratio, seed=args.seed)
    results, duration, prefix = await run_load(
        args.url, requests, model=args.model or info.model, request_rate=args.request_rate,
        seed=args.seed, api_key=args.api_key, max_concurrency=args.max_concurrency,
        progress=not args.no_progress)
    metrics = compute_metrics(results, duration, prefix)
    config = {"dataset": args.dataset, "num_prompts": args.num_prompts,
              "request_rate": str(args.request_rate),  # "inf" is not JSON as a number
              "input_len": args.input_len,
              "output_len": args.output_len, "seed": args.seed, "model": info.model,
              "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else 0,
              "max_concurrency": args.max_concurrency}
    if args.json:
        print(json.dumps({"config": config, **metrics}, indent=2))
    else:
        print(f"dataset={args.dataset} num_prompts={args.num_prompts} "
              f"request_rate={args.request_rate} input_len={args.input_len} "
              f"output_len={args.output_len} prefix_len={config['prefix_len']}", file=sys.stderr)
        print(format_table(metrics))
    return 0 if metrics["failed"] == 0 else 1
