"""The fused CPU decode attention kernel alone (`paged_decode_attention`), at the serving shape.

    PYTHONPATH=$PWD python benchmarks/bench_decode_kernel.py [--dtypes bfloat16,float32]
        [--batch 64] [--context 320] [--heads 8/4] [--threads 1] [--reps 30]
        [--baseline GIT_REF --repeat 2]

One layer's decode step of bench_core_profile.py's workload: `--batch` sequences of
`--context` tokens, 8 query heads over 4 KV heads of 64 (`--heads`: query / KV heads), block
size 32, in a cache of `--num-blocks` (8,192) blocks; the blocks of each sequence either
consecutive ("contig", as a fresh pool hands them out) or scattered at random ("rand"). One
thread by default; a call's time is this thread's CPU time (time.thread_time), the fastest of
`--reps`, so other processes on a shared machine count little. `--threads N` (N > 1): wall
clock on N threads instead (how a call of few sequences shares its context out over them;
on a shared machine a ratio within one run). Prints ms per call and the K/V bytes read per
second. --baseline GIT_REF: the same in
child processes, GIT_REF's `pagedkv` against this tree's, alternating `--repeat` times, with
the ratio of the medians (above 1: this tree is faster).

    PYTHONPATH=$PWD python benchmarks/bench_decode_kernel.py --candidates
        [--dtypes bfloat16] [--classes 9/3,8/4,8/1] [--contexts 512,2048,8192] [--batches 1,8]

--candidates: decode_choice.py's candidates for each class (query / KV heads, head size 64,
block size 16, a cache of the model's dtype) and batch x context: the fused kernel ("native",
which on two threads cuts a call of fewer sequences x KV heads than four into parts of the
context) and torch's attention over gathered blocks ("torch"); each timed on one thread (its
CPU time) and on two (wall clock, the candidates alternating call by call, the fastest of
`--reps`), with the route decode_choice takes from its measured table and the native kernel's
speed-up from one thread to two. Prints the CPU's AMX flag and the load average: on a shared
machine the two-thread figures hold only as ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 32
LAYOUTS = ("contig", "rand")


def measure(dtype_name: str, batch: int, context: int, reps: int, num_blocks: int,
            heads: int = HEADS, kv_heads: int = KV_HEADS, threads: int = 1) -> dict[str, float]:
    """{layout: best ms per call} for this process's build (`threads` > 1: wall clock)."""
    from pagedkv.kernels.cpu import ensure_cpu_kernels
    from pagedkv.model.kv_cache import zeros_in_huge_pages

    ensure_cpu_kernels("wait")
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dtype_name)
    shape = (kv_heads, num_blocks, BLOCK, HEAD_DIM)
    # In 2 MiB pages where Linux gives them, as the engine's cache (model/kv_cache.py): with
    # 4 KiB pages every scattered block read would also miss the TLB.
    k_cache = zeros_in_huge_pages(shape, dtype, torch.device("cpu"))
    v_cache = zeros_in_huge_pages(shape, dtype, torch.device("cpu"))
    k_cache.copy_(torch.randn(shape, generator=gen))
    v_cache.copy_(torch.randn(shape, generator=gen))
    per_seq = -(-context // BLOCK)
    q = torch.randn(batch, heads, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)
    first, lens = torch.zeros(batch, dtype=torch.long), torch.full((batch,), context)
    best = {}
    for layout in LAYOUTS:
        ids = torch.arange(batch * per_seq) if layout == "contig" else \
            torch.randperm(num_blocks - 1, generator=gen)[: batch * per_seq]
        tables = (ids + 1).view(batch, per_seq)
        times = []
        for _ in range(reps + 1):
            start = clock()
            torch.ops.pagedkv_cpu.paged_decode_attention(q, k_cache, v_cache, tables, first, lens,
                                                         HEAD_DIM ** -0.5, out, None)
            times.append(clock() - start)
        best[layout] = 1e3 * min(times[1:])
    return best


def kv_bytes(dtype_name: str, batch: int, context: int, kv_heads: int = KV_HEADS) -> int:
    return 2 * batch * kv_heads * context * HEAD_DIM * getattr(torch, dtype_name).itemsize


def head_counts(spec: str) -> tuple[int, int]:
    """(query heads, KV heads) of "Q/KV"."""
    heads, kv_heads = map(int, spec.split("/"))
    if heads % kv_heads:
        raise ValueError(f"--heads {spec}: the query heads must be a multiple of the KV heads")
    return heads, kv_heads


def child(tree: str, args: argparse.Namespace, dtype: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--dtypes", dtype, "--batch", str(args.batch),
           "--context", str(args.context), "--reps", str(args.reps), "--num-blocks",
           str(args.num_blocks), "--heads", args.heads, "--threads", str(args.threads), "--json"]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": tree}, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])[dtype]


def compare(args: argparse.Namespace) -> None:
    from pagedkv.bench.baseline import baseline_tree
    from pagedkv.bench.machine import cpu_name

    here = str(Path(__file__).resolve().parents[1])
    clock = "CPU time, 1 thread" if args.threads == 1 else f"wall clock, {args.threads} threads"
    print(f"{cpu_name()}: paged_decode_attention, {args.batch} x {args.context} tokens, heads "
          f"{args.heads}, ms per call ({clock}), {args.baseline} vs this tree, {args.repeat} "
          f"alternating runs")
    kv_heads = head_counts(args.heads)[1]
    with baseline_tree(here, args.baseline) as base:
        for dtype in args.dtypes.split(","):
            runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
            for _ in range(args.repeat):
                runs["base"].append(child(base, args, dtype))
                runs["this"].append(child(here, args, dtype))
            for layout in LAYOUTS:
                b, t = (statistics.median(r[layout] for r in runs[side]) for side in ("base", "this"))
                print(f"  {dtype:8} {layout:6} {b:7.3f} -> {t:7.3f} ms  ({b / t:.2f}x; "
                      f"{kv_bytes(dtype, args.batch, args.context, kv_heads) / t / 1e6:.1f} GB/s)")


def best_times(calls: dict, reps: int, threads: int) -> dict[str, float]:
    """{name: fastest call in ms} of `calls` alternating, on `threads` threads (one: the
    thread's CPU time; more: wall clock)."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    torch.set_num_threads(threads)
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(reps):
        for name, call in calls.items():
            start = clock()
            call()
            best[name] = min(best[name], clock() - start)
    return {name: 1e3 * t for name, t in best.items()}


def candidates(args: argparse.Namespace) -> None:
    from pagedkv.bench.machine import cpu_name
    from pagedkv.kernels.cpu import ensure_cpu_kernels
    from pagedkv.model import decode_choice

    ensure_cpu_kernels("wait")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    print(f"CPU: {cpu_name()}; AMX: {'amx_bf16' in flags}; load {os.getloadavg()[0]:.1f}; "
          f"ms per call, best of {args.reps}: 1 thread (CPU time) | 2 threads (wall)")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for spec in args.classes.split(","):
            heads, kv_heads = map(int, spec.split("/"))
            cls = decode_choice.DecodeClass(dtype, heads, kv_heads, HEAD_DIM, 16, dtype)
            decode_choice.decode_table(cls)
            for batch in map(int, args.batches.split(",")):
                for context in map(int, args.contexts.split(",")):
                    calls = decode_choice.decode_candidates(
                        cls, batch, context, torch.Generator().manual_seed(0))
                    one, two = (best_times(calls, args.reps, t) for t in (1, 2))
                    route = decode_choice.decode_route(cls, batch, context)
                    cells = "  ".join(f"{k} {one[k]:.3f} | {two[k]:.3f}" for k in calls)
                    print(f"{dtype_name:8} {spec:>5} batch {batch:>2} context {context:>5}: "
                          f"{cells}  -> {route} (native, 1 thread / 2: "
                          f"{one['native'] / two['native']:.2f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--heads", default=f"{HEADS}/{KV_HEADS}", help="query / KV heads")
    parser.add_argument("--threads", type=int, default=1,
                        help="above 1: wall clock on this many threads")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--baseline", default=None, metavar="GIT_REF")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--candidates", action="store_true",
                        help="decode_choice's candidates, one and two threads")
    parser.add_argument("--classes", default="9/3,8/4,8/1", help="query/KV heads, --candidates")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.candidates:
        candidates(args)
        return
    if args.baseline:
        compare(args)
        return
    if args.num_blocks <= args.batch * -(-args.context // BLOCK):
        raise ValueError(f"--num-blocks {args.num_blocks} cannot hold {args.batch} sequences of "
                         f"{args.context} tokens")
    heads, kv_heads = head_counts(args.heads)
    results = {d: measure(d, args.batch, args.context, args.reps, args.num_blocks, heads,
                          kv_heads, args.threads)
               for d in args.dtypes.split(",")}
    if args.json:
        print(json.dumps(results))
        return
    for dtype, best in results.items():
        for layout, ms in best.items():
            print(f"{dtype:8} {layout:6} {ms:6.2f} ms  "
                  f"{kv_bytes(dtype, args.batch, args.context, kv_heads) / ms / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
