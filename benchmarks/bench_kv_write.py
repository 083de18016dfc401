"""The int8 KV write (`write_kv_int8_`: per-token scale search, quantization, store) against the
model-dtype cache's (`write_kv_`), per token and KV head (issue 25).

One call writes `--tokens` tokens' K (or V) of the benchmark model's KV heads (4 of `--head-size`)
in bfloat16 into shuffled slots; int8 needs two calls (K, then V), write_kv_ one for both. Calls
alternate; each side's best of `--repeat`. Prints ns per vector and the int8 (K + V) / write_kv_
time ratio (the extra write cost of an int8 cache; > 1: int8 is slower).

    PYTHONPATH=. python benchmarks/bench_kv_write.py [--tokens 2048] [--head-size 64]
        [--threads 1] [--repeat 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels

KV_HEADS, BLOCK = 4, 16


def best_seconds(calls: dict, repeat: int) -> dict[str, float]:
    """The best wall time of each call in `calls` over `repeat` alternating rounds (after one
    untimed round: the caches' pages are touched first)."""
    for call in calls.values():
        call()
    best = {name: float("inf") for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_cpu_kernels("wait")
    ops = torch.ops.pagedkv_cpu
    t, d = args.tokens, args.head_size
    blocks = (t + BLOCK - 1) // BLOCK
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(t, KV_HEADS, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(t, KV_HEADS, d, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:t]
    k8 = torch.zeros(KV_HEADS, blocks, BLOCK, d, dtype=torch.int8)
    v8, ks, vs = torch.zeros_like(k8), torch.zeros(KV_HEADS, blocks, BLOCK), torch.zeros(KV_HEADS, blocks, BLOCK)
    kb = torch.zeros(KV_HEADS, blocks, BLOCK, d, dtype=torch.bfloat16)
    vb = torch.zeros_like(kb)

    def int8() -> None:
        ops.write_kv_int8_(k, k8, ks, slots)
        ops.write_kv_int8_(v, v8, vs, slots)

    best = best_seconds({"int8": int8, "bfloat16": lambda: ops.write_kv_(k, v, kb, vb, slots)},
                        args.repeat)
    vectors = 2 * t * KV_HEADS
    for name, s in best.items():
        print(f"{name}: {s * 1e3:.3f} ms per K+V write, {s / vectors * 1e9:.1f} ns per vector")
    print(f"int8 / bfloat16 write time: {best['int8'] / best['bfloat16']:.2f}x "
          f"({t} tokens, {KV_HEADS} KV heads of {d}, {args.threads} thread(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
