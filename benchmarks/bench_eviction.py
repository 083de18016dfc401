"""Eviction policies (LRU, LFU, ARC) on a scan-heavy workload: prefix-cache hit rate and
throughput per policy in one run, with each policy's ratio to LRU.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_eviction.py [--requests 4000] [--engine]
                                                               [--engine-requests 64] [--json]

The workload: `--hot` shared prefixes of `--hot-blocks` blocks (the hot set, an eighth of the
cache by default), each request's prefix followed by a fresh question of one to two blocks,
make up `--hot-fraction` of the requests; the rest are a scan of one-off prompts of
`--scan-blocks` blocks that never come back. Between two uses of one hot prefix the scan
streams about twice the whole cache through it (the script prints the exact figure), so LRU,
which keeps what was freed last, loses the hot set over and over, while LFU (the hot blocks
count many uses) and ARC (the hot blocks sit in T2, the scan in T1) keep it. Every policy sees
the same request sequence. Hit rate = prefix-cache hit tokens / prompt tokens.

Two levels:
- the block manager alone (default; pure Python, fast, thousands of requests): each request is
  admitted like the scheduler admits it (prefix hit, allocate the rest), `--concurrency`
  requests are held at once, the oldest freed (tail first) as the next arrives; throughput is
  requests per second of that bookkeeping;
- `--engine`: the same workload, smaller (`--engine-requests`), through `LLMEngine` with a tiny
  random-weight Llama (one generated token each, `--engine-concurrency` requests in flight);
  hit rate from the engine's own counters, throughput in prompt tokens per second (a hit is a
  prefill not computed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from bench_kv import BenchRequest  # this directory is on sys.path when run as a script

from pagedkv.kv.eviction import EVICTION_POLICIES
from pagedkv.kv.manager import KVCacheManager

POLICIES = ["lru", "lfu", "arc"]  # LRU first: the baseline of the ratios


def workload(args: argparse.Namespace, num_requests: int, vocab: int) -> list[list[int]]:
    """The request sequence (token ids), the same for every policy."""
    return _workload(args, num_requests, vocab)[0]


def hit_rate_ceiling(args: argparse.Namespace, num_requests: int, vocab: int) -> float:
    """The hit rate of a cache that never evicts: every hot prefix hits after its first use."""
    prompts, hot_uses = _workload(args, num_requests, vocab)
    seen: set[int] = set()
    hits = 0
    for index in hot_uses:
        if index in seen:
            hits += args.hot_blocks * args.block_size
        seen.add(index)
    return hits / sum(len(p) for p in prompts)


def _workload(args: argparse.Namespace, num_requests: int,
              vocab: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, the hot prefix index of each hot request in order)."""
    rng = random.Random(args.seed)
    bs = args.block_size
    hot = [[rng.randrange(4, vocab) for _ in range(args.hot_blocks * bs)]
           for _ in range(args.hot)]
    prompts, hot_uses = [], []
    for _ in range(num_requests):
        if rng.random() < args.hot_fraction:
            question = [rng.randrange(4, vocab) for _ in range(rng.randint(bs, 2 * bs))]
            index = rng.randrange(len(hot))
            hot_uses.append(index)
            prompts.append(hot[index] + question)
        else:
            prompts.append([rng.randrange(4, vocab) for _ in range(args.scan_blocks * bs + 1)])
    return prompts, hot_uses


def scan_blocks_between_uses(args: argparse.Namespace) -> float:
    """Expected scan blocks streamed between two uses of one hot prefix."""
    requests_between = args.hot / args.hot_fraction
    return requests_between * (1 - args.hot_fraction) * args.scan_blocks


def run_manager(policy: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Admit every prompt through a KVCacheManager with `policy`; hit rate and requests/s."""
    mgr = KVCacheManager(num_blocks=args.cache_blocks + 1, block_size=args.block_size,
                         watermark=0.0, eviction_policy=policy)
    live: deque[BenchRequest] = deque()
    start = time.perf_counter()
    for i, tokens in enumerate(prompts):
        req = BenchRequest(f"r{i}", tokens)
        while True:
            hits, num_hit = mgr.get_computed_blocks(req)
            if mgr.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit) is not None:
                break
            if not live:
                raise RuntimeError(f"request {i} does not fit in an empty cache")
            mgr.free(live.popleft())  # no room: the oldest request finishes first
        req.num_computed_tokens = req.num_tokens
        live.append(req)
        if len(live) > args.concurrency:
            mgr.free(live.popleft())
    while live:
        mgr.free(live.popleft())
    elapsed = time.perf_counter() - start
    mgr.check_invariants()
    stats = mgr.prefix_cache_stats
    # Retried admissions query again: count each request's prompt once.
    prompt_tokens = sum(len(p) for p in prompts)
    return {"policy": policy, "hit_rate": stats.hits / prompt_tokens,
            "hit_tokens": stats.hits, "prompt_tokens": prompt_tokens,
            "seconds": elapsed, "requests_per_s": len(prompts) / elapsed}


def run_engine(policy: str, model_dir: Path, prompts: list[list[int]],
               args: argparse.Namespace) -> dict:
    """The prompts through LLMEngine (one generated token each); hit rate and prompt tok/s."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(model_dir), seed=0, block_size=args.block_size,
              num_gpu_blocks_override=args.engine_cache_blocks + 1, watermark=0.0,
              max_num_seqs=args.engine_concurrency, eviction_policy=policy)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    warmup = [[5 + i] * (n * args.block_size + 1) for i, n in enumerate(
        (1, args.hot_blocks + 1, args.scan_blocks, args.scan_blocks))]
    llm.generate([{"prompt_token_ids": w} for w in warmup], params, use_tqdm=False)  # untimed
    base = engine.get_stats()
    pending = deque(enumerate(prompts))
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and engine.get_num_unfinished_requests() < args.engine_concurrency:
            i, tokens = pending.popleft()
            engine.add_request(f"r{i}", {"prompt_token_ids": tokens}, params)
        engine.step()
    elapsed = time.perf_counter() - start
    engine.check_invariants()
    stats = engine.get_stats()
    llm.shutdown()
    prompt_tokens = sum(len(p) for p in prompts)
    hits = stats.prefix_cache_hits - base.prefix_cache_hits
    return {"policy": policy, "hit_rate": hits / prompt_tokens, "hit_tokens": hits,
            "prompt_tokens": prompt_tokens, "seconds": elapsed,
            "prompt_tokens_per_s": prompt_tokens / elapsed}


def best_of(repeats: int, run) -> list[dict]:
    """`run(policy)` `repeats` times per policy, the order rotating each round (so no policy
    always runs first on a busy machine); per policy the fastest run (hit rates are the same
    every time: the workload and the engine are deterministic)."""
    best: dict[str, dict] = {}
    for round_ in range(repeats):
        for policy in POLICIES[round_ % 3:] + POLICIES[:round_ % 3]:
            result = run(policy)
            old = best.get(policy)
            if old is not None:
                assert old["hit_tokens"] == result["hit_tokens"], "hit rates must not vary"
            if old is None or result["seconds"] < old["seconds"]:
                best[policy] = result
    return [best[p] for p in POLICIES]


def with_ratios(results: list[dict], key: str) -> list[dict]:
    base = results[0]
    for r in results:
        r["hit_rate_vs_lru"] = r["hit_rate"] / base["hit_rate"] if base["hit_rate"] else None
        r[f"{key}_vs_lru"] = r[key] / base[key]
    return results


def print_table(title: str, results: list[dict], key: str, unit: str) -> None:
    print(f"\n{title}")
    print(f"{'policy':<8}{'hit rate':>10}{'x LRU':>9}{unit:>16}{'x LRU':>9}")
    for r in results:
        ratio = r["hit_rate_vs_lru"]
        print(f"{r['policy']:<8}{r['hit_rate']:>10.1%}"
              f"{'inf' if ratio is None else f'{ratio:.2f}':>9}"
              f"{r[key]:>16.1f}{r[f'{key}_vs_lru']:>9.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=512, help="usable device blocks")
    parser.add_argument("--hot", type=int, default=8, help="shared hot prefixes")
    parser.add_argument("--hot-blocks", type=int, default=8, help="blocks per hot prefix")
    parser.add_argument("--hot-fraction", type=float, default=0.3)
    parser.add_argument("--scan-blocks", type=int, default=48, help="blocks per one-off prompt")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", action="store_true", help="also run through LLMEngine")
    parser.add_argument("--engine-requests", type=int, default=96)
    parser.add_argument("--engine-cache-blocks", type=int, default=64)
    parser.add_argument("--engine-hot", type=int, default=4)
    parser.add_argument("--engine-hot-blocks", type=int, default=4)
    parser.add_argument("--engine-hot-fraction", type=float, default=0.5)
    parser.add_argument("--engine-scan-blocks", type=int, default=32)
    parser.add_argument("--engine-concurrency", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per policy, in rotating order; the fastest is kept")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="write a PNG of the hit rate per policy (matplotlib)")
    args = parser.parse_args(argv)
    assert sorted(POLICIES) == sorted(EVICTION_POLICIES), "a policy is missing from the bench"

    vocab = 30000
    report: dict = {"workload": {k: v for k, v in vars(args).items() if k != "json"}}
    report["workload"]["scan_blocks_between_hot_uses"] = scan_blocks_between_uses(args)
    prompts = workload(args, args.requests, vocab)
    report["workload"]["hit_rate_ceiling"] = hit_rate_ceiling(args, args.requests, vocab)
    report["manager"] = with_ratios(best_of(args.repeats, lambda p: run_manager(
        p, prompts, args)), "requests_per_s")
    if args.engine:
        from pagedkv.testing import build_random_model_dir

        engine_args = argparse.Namespace(**{
            **vars(args), **{name: getattr(args, "engine_" + name) for name in (
                "scan_blocks", "cache_blocks", "hot", "hot_blocks", "hot_fraction")}})
        report["workload"]["engine_scan_blocks_between_hot_uses"] = \
            scan_blocks_between_uses(engine_args)
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_random_model_dir(Path(tmp) / "model", dtype="float32", seed=0)
            from pagedkv.testing.random_model import tokenizer_vocab_size

            engine_vocab = tokenizer_vocab_size(model_dir)
            engine_prompts = workload(engine_args, args.engine_requests, engine_vocab)
            report["workload"]["engine_hit_rate_ceiling"] = hit_rate_ceiling(
                engine_args, args.engine_requests, engine_vocab)
            report["engine"] = with_ratios(best_of(args.repeats, lambda p: run_engine(
                p, model_dir, engine_prompts, engine_args)), "prompt_tokens_per_s")
    if args.plot:
        from pagedkv.bench.plot import bar_chart

        series = {"block manager": [r["hit_rate"] for r in report["manager"]]}
        if args.engine:
            series["engine"] = [r["hit_rate"] for r in report["engine"]]
        bar_chart(args.plot, "prefix-cache hit rate per eviction policy",
                  [r["policy"] for r in report["manager"]], series, ylabel="hit rate")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    w = report["workload"]
    print(f"cache {args.cache_blocks} blocks of {args.block_size}; hot set {args.hot} x "
          f"{args.hot_blocks} blocks ({args.hot_fraction:.0%} of requests); scan prompts "
          f"{args.scan_blocks} blocks; ~{w['scan_blocks_between_hot_uses']:.0f} scan blocks "
          f"({w['scan_blocks_between_hot_uses'] / args.cache_blocks:.1f}x the cache) between "
          f"two uses of a hot prefix")
    print_table(f"block manager, {args.requests} requests (a cache that never evicts: "
                f"{w['hit_rate_ceiling']:.1%})", report["manager"], "requests_per_s",
                "requests/s")
    if args.engine:
        print(f"\nengine: cache {args.engine_cache_blocks} blocks; hot set {engine_args.hot} x "
              f"{engine_args.hot_blocks} blocks ({engine_args.hot_fraction:.0%} of requests); "
              f"scan prompts {args.engine_scan_blocks} blocks; "
              f"~{w['engine_scan_blocks_between_hot_uses']:.0f} scan blocks "
              f"({w['engine_scan_blocks_between_hot_uses'] / args.engine_cache_blocks:.1f}x the "
              f"cache) between two uses of a hot prefix")
        print_table(f"engine (tiny random Llama), {args.engine_requests} requests (a cache "
                    f"that never evicts: {w['engine_hit_rate_ceiling']:.1%})",
                    report["engine"], "prompt_tokens_per_s", "prompt tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
