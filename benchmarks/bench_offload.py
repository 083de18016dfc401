"""Tiered KV store: a prefix-repetition workload whose prefixes overflow the device KV cache.

    .venv/bin/python benchmarks/bench_offload.py [--prefixes 8] [--prefix-len 1024] [--rounds 4]
                                                 [--device-blocks 128] [--threads 1] [--json]

`--prefixes` distinct prefixes of `--prefix-len` tokens, each followed by a fresh 16-token
suffix, are requested round-robin for `--rounds` rounds, one request at a time (8 output
tokens, greedy): the total prefix size is at least twice the device KV capacity
(`--device-blocks` blocks of 16 tokens), so by the time a prefix comes back the device has
evicted it. The same workload runs with no tier, the host tier, the disk tier and the Redis tier
(a real redis-server started here), in one run: prompt tokens computed, TTFT mean and p99, and
output tokens/s; each tier's mean TTFT is compared with no tier's (ratio), over all requests
(the first round computes every prefix, whatever the tier) and over the repeated prefixes only
(rounds after the first). Then a warm restart:
a new engine on the disk tier's directory runs one more round, compared with the disk run's
steady state (its rounds after the first).

Transfer unit: with the Redis tier running, one prefix's blocks are read three ways, one GET per
block, one MGET of all its blocks (what the tier does), and chunks of 16 blocks stored as one
value each (LMCache's 256-token chunks): the time per prefix of each.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# bench_offline.py's random Llama: big enough that a prefill costs far more than a step's overhead.
SHAPE = dict(arch="llama", hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
             num_kv_heads=4, max_position_embeddings=4096)
BLOCK_SIZE = 16
SUFFIX_LEN = 16
OUTPUT_LEN = 8


def workload(seed: int, vocab: int, num_prefixes: int, prefix_len: int,
             rounds: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [p + [rng.randrange(4, vocab) for _ in range(SUFFIX_LEN)]
            for _ in range(rounds) for p in prefixes]


def run(model_dir: Path, prompts: list[list[int]], device_blocks: int, **tier_args) -> dict:
    """Run the prompts one at a time; per-request TTFT, tokens computed, throughput."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(model=str(model_dir), seed=0, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=device_blocks, max_num_seqs=1, **tier_args)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    warmup = [random.Random(-1).randrange(4, 200) for _ in range(2 * BLOCK_SIZE + 3)]
    llm.generate([{"prompt_token_ids": warmup}], params, use_tqdm=False)  # not timed
    ttfts, cached, outputs = [], 0, []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if out.finished:
                    cached += out.num_cached_tokens
                    outputs.append(list(out.outputs[0].token_ids))
        ttfts.append(first)
    elapsed = time.perf_counter() - start
    if engine.kv_store is not None:
        engine.kv_store.flush()
    stats = engine.get_stats()
    engine.check_invariants()
    if engine.kv_store is not None:
        engine.kv_store.close()
    prompt_tokens = sum(len(p) for p in prompts)
    return dict(ttfts=ttfts, ttft_mean=statistics.fmean(ttfts),
                ttft_p99=sorted(ttfts)[max(0, round(0.99 * len(ttfts)) - 1)],
                prompt_tokens=prompt_tokens, prompt_tokens_computed=prompt_tokens - cached,
                output_tokens_per_s=len(prompts) * OUTPUT_LEN / elapsed, seconds=elapsed,
                tiers={t["name"]: {k: t[k] for k in ("hits", "misses", "bytes_read",
                                                     "bytes_written")}
                       for t in stats.kv_store_tiers},
                outputs=outputs)


def transfer_units(url: str, block_bytes: int, num_blocks: int, reps: int = 20) -> dict:
    """Seconds to read one prefix of `num_blocks` blocks from Redis, three ways."""
    import redis

    client = redis.Redis.from_url(url)
    payload = bytes(block_bytes)
    keys = [f"bench:block:{i}".encode() for i in range(num_blocks)]
    chunk = 16
    chunk_keys = [f"bench:chunk:{i}".encode() for i in range(0, num_blocks, chunk)]
    client.mset({k: payload for k in keys})
    client.mset({k: payload * chunk for k in chunk_keys})

    def timed(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps

    result = dict(
        get_per_block=timed(lambda: [client.get(k) for k in keys]),
        mget_per_prefix=timed(lambda: client.mget(keys)),
        chunks_of_16_blocks=timed(lambda: client.mget(chunk_keys)),
        blocks=num_blocks, block_bytes=block_bytes)
    client.delete(*keys, *chunk_keys)
    client.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--device-blocks", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (default 1: far less disturbed by other "
                             "processes on a shared box; 0 keeps torch's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedkv.store.redis_server import RedisServer
    from pagedkv.testing import build_random_model_dir

    capacity = (args.device_blocks - 1) * BLOCK_SIZE
    total_prefix = args.prefixes * args.prefix_len
    if total_prefix < 2 * capacity:
        raise SystemExit(f"total prefix {total_prefix} tokens is under twice the device "
                         f"capacity {capacity}: raise --prefixes or lower --device-blocks")
    report: dict = {"workload": dict(prefixes=args.prefixes, prefix_len=args.prefix_len,
                                     rounds=args.rounds, device_capacity_tokens=capacity,
                                     total_prefix_tokens=total_prefix)}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(maxmemory="512mb") as server:
        model_dir = build_random_model_dir(Path(tmp) / "model", dtype="float32", seed=0, **SHAPE)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = workload(0, vocab, args.prefixes, args.prefix_len, args.rounds)
        disk = str(Path(tmp) / "kv")
        configs = {
            "none": {},
            "host": dict(kv_offloading_size=1.0),
            "disk": dict(kv_offloading_disk_path=disk, kv_offloading_disk_size=4.0),
            "redis": dict(kv_offloading_remote_url=server.url),
        }
        runs = {name: run(model_dir, prompts, args.device_blocks, **cfg)
                for name, cfg in configs.items()}
        base = runs["none"]
        reference = base["outputs"]
        for r in runs.values():  # rounds after the first: every prefix was seen before
            r["ttft_mean_repeats"] = statistics.fmean(r["ttfts"][args.prefixes:])
        for name, r in runs.items():
            r["ttft_ratio_vs_none"] = base["ttft_mean"] / r["ttft_mean"]
            r["repeats_ttft_ratio_vs_none"] = base["ttft_mean_repeats"] / r["ttft_mean_repeats"]
            r["same_tokens_as_none"] = r.pop("outputs") == reference
            print(f"[{name:5}] computed {r['prompt_tokens_computed']:6d}/{r['prompt_tokens']} "
                  f"prompt tokens, TTFT mean {1e3 * r['ttft_mean']:7.1f} ms "
                  f"p99 {1e3 * r['ttft_p99']:7.1f} ms, {r['output_tokens_per_s']:6.1f} out tok/s; "
                  f"TTFT vs none {r['ttft_ratio_vs_none']:.2f}x lower (repeated prefixes only: "
                  f"{r['repeats_ttft_ratio_vs_none']:.2f}x); same tokens: "
                  f"{r['same_tokens_as_none']}", flush=True)
        # Warm restart: a new engine on the disk tier's directory, one more round.
        rng = random.Random(2)  # the same prefixes as the first run, fresh suffixes
        prefixes = [p[:args.prefix_len] for p in prompts[:args.prefixes]]
        restart_prompts = [p + [rng.randrange(4, vocab) for _ in range(SUFFIX_LEN)]
                           for p in prefixes]
        warm = run(model_dir, restart_prompts, args.device_blocks, **configs["disk"])
        warm.pop("outputs")
        steady = runs["disk"]["ttft_mean_repeats"]
        warm["ttft_ratio_vs_steady"] = warm["ttft_mean"] / steady
        print(f"[restart] disk tier after a restart: computed {warm['prompt_tokens_computed']}"
              f"/{warm['prompt_tokens']} prompt tokens, TTFT mean {1e3 * warm['ttft_mean']:.1f} "
              f"ms vs warm steady state {1e3 * steady:.1f} ms: "
              f"{warm['ttft_ratio_vs_steady']:.2f}x", flush=True)
        report["runs"] = runs
        report["warm_restart"] = warm
        report["warm_steady_ttft_mean"] = steady
        block_bytes = SHAPE["num_layers"] * 2 * SHAPE["num_kv_heads"] * BLOCK_SIZE * \
            (SHAPE["hidden_size"] // SHAPE["num_heads"]) * 4
        units = transfer_units(server.url, block_bytes, args.prefix_len // BLOCK_SIZE)
        report["transfer_units"] = units
        print(f"[unit] one prefix of {units['blocks']} blocks of {block_bytes} B from Redis: "
              f"GET per block {1e3 * units['get_per_block']:.2f} ms, one MGET "
              f"{1e3 * units['mget_per_prefix']:.2f} ms, 16-block chunks "
              f"{1e3 * units['chunks_of_16_blocks']:.2f} ms", flush=True)
    for r in report["runs"].values():
        r.pop("ttfts")
    report["warm_restart"].pop("ttfts")
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
