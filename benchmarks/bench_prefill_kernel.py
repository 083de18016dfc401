"""The tiled paged prefill attention kernel (`paged_prefill_attention`) against the torch path
it replaces (attention.prefill_attention: gathered blocks and SDPA's flash kernel), one layer.

    PYTHONPATH=$PWD python benchmarks/bench_prefill_kernel.py [--dtypes float32,bfloat16]
        [--head-dims 64,128] [--reps 10]

The shapes of bench_shared_prefix.py's workloads: 8 query heads over 4 KV heads (the head size
as given), block size 32, blocks of a sequence scattered at random in a cache of 1,024; a chunk
of 32 new tokens after a cached 1,024-token prefix ("32 after 1024"), a whole 1,056-token prompt
("1056 from 0") and a 256-token one ("256 from 0"). One thread; a call's time is this thread's
CPU time (time.thread_time), the fastest of `--reps`, so other processes on a shared machine
count little. Prints ms per call, GFLOP/s (4 x heads x head size x keys attended) and the ratio
torch / tiled (above 1: the kernel is faster).
"""

from __future__ import annotations

import argparse
import time

import torch

HEADS, KV_HEADS, BLOCK, NUM_BLOCKS = 8, 4, 32, 1024
SHAPES = ((1024, 32), (0, 1056), (0, 256))  # (cached tokens, new tokens)


def best_cpu_seconds(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def measure(dtype: torch.dtype, head_dim: int, cached: int, new: int, reps: int) -> tuple[float, float]:
    """(torch path seconds, tiled kernel seconds) of one chunk's attention."""
    from pagedkv.model.attention import PrefillChunk, prefill_attention

    gen = torch.Generator().manual_seed(0)
    length = cached + new
    k_cache = torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, head_dim, generator=gen).to(dtype)
    table = torch.randperm(NUM_BLOCKS - 1, generator=gen)[: -(-length // BLOCK)] + 1
    q = torch.randn(new, HEADS, head_dim, generator=gen).to(dtype)
    slots = table.repeat_interleave(BLOCK)[cached:length] * BLOCK + torch.arange(cached, length) % BLOCK
    k = k_cache.view(KV_HEADS, -1, head_dim)[:, slots].transpose(0, 1)
    v = v_cache.view(KV_HEADS, -1, head_dim)[:, slots].transpose(0, 1)
    chunk = PrefillChunk(0, new, cached, length, table)
    scale = head_dim ** -0.5
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, table[None], torch.tensor([0]), torch.tensor([new]),
            torch.tensor([length]), 0, scale, out)
    want = prefill_attention(q, k, v, k_cache, v_cache, chunk, scale, None)
    torch.ops.pagedkv_cpu.paged_prefill_attention(*args)
    assert float((out.float() - want.float()).abs().max()) < 0.05, "kernel and torch path differ"
    t_torch = best_cpu_seconds(lambda: prefill_attention(q, k, v, k_cache, v_cache, chunk, scale,
                                                         None), reps)
    t_tiled = best_cpu_seconds(lambda: torch.ops.pagedkv_cpu.paged_prefill_attention(*args), reps)
    return t_torch, t_tiled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    from pagedkv.bench.machine import cpu_name
    from pagedkv.kernels.cpu import ensure_cpu_kernels

    ensure_cpu_kernels("wait")
    torch.set_num_threads(1)
    print(f"CPU: {cpu_name()}; one thread, best thread CPU time of {args.reps}")
    print(f"{'dtype':<10}{'D':>4}  {'shape':<14}{'torch ms':>10}{'GF/s':>7}{'tiled ms':>10}"
          f"{'GF/s':>7}{'ratio':>8}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for d in (int(x) for x in args.head_dims.split(",")):
            if not torch.ops.pagedkv_cpu.paged_prefill_supports(d, dtype):
                print(f"{name:<10}{d:>4}  no tiled kernel in this build")
                continue
            for cached, new in SHAPES:
                t_torch, t_tiled = measure(dtype, d, cached, new, args.reps)
                flops = 4 * HEADS * d * sum(range(cached + 1, cached + new + 1))
                print(f"{name:<10}{d:>4}  {f'{new} from {cached}' if not cached else f'{new} after {cached}':<14}"
                      f"{1e3 * t_torch:>10.3f}{flops / t_torch / 1e9:>7.0f}{1e3 * t_tiled:>10.3f}"
                      f"{flops / t_tiled / 1e9:>7.0f}{t_torch / t_tiled:>7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
