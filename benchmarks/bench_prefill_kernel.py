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
torch / tiled (above 1: the kernel is faster), then the chunk lengths from which the engine's
measured choice (prefill_choice.py) takes torch's path for this class, fresh and after a prefix.

    PYTHONPATH=$PWD python benchmarks/bench_prefill_kernel.py --amx-compare [--threads 1,2]

--amx-compare: whether torch's path (SDPA's flash kernel, whose bfloat16 products are oneDNN
brgemm) runs AMX tiles: each shape's torch path timed in two child processes, one with oneDNN
as it is and one capped at AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA), on each of `--threads`
(one: CPU time; more: wall clock, best of `--reps`); prints the CPU's AMX flag, the load and
the ratio (above 1: AMX is faster).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

HEADS, KV_HEADS, BLOCK, NUM_BLOCKS = 8, 4, 32, 1024
SHAPES = ((1024, 32), (1024, 128), (4096, 64), (0, 1056), (0, 256))  # (cached, new tokens)
NO_AMX = "AVX512_CORE_BF16"


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


def torch_times(threads: int, reps: int) -> dict[str, float]:
    """{shape: ms of torch's path} in bfloat16, head size 64, on `threads` threads (one: CPU
    time; more: wall clock)."""
    from pagedkv.model.attention import PrefillChunk, prefill_attention

    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    out = {}
    for cached, new in SHAPES:
        length, d = cached + new, 64
        q = torch.randn(new, HEADS, d, generator=gen).bfloat16()
        k_cache, v_cache = (torch.randn(KV_HEADS, NUM_BLOCKS, BLOCK, d, generator=gen).bfloat16()
                            for _ in range(2))
        table = torch.arange(-(-length // BLOCK))
        k, v = (c.view(KV_HEADS, -1, d)[:, cached:length].transpose(0, 1)
                for c in (k_cache, v_cache))
        chunk = PrefillChunk(0, new, cached, length, table)
        call = functools.partial(prefill_attention, q, k, v, k_cache, v_cache, chunk, d ** -0.5,
                                 None)
        call()
        best = float("inf")
        for _ in range(reps):
            start = clock()
            call()
            best = min(best, clock() - start)
        out[f"{new} after {cached}"] = 1e3 * best
    return out


def amx_compare(args: argparse.Namespace) -> None:
    """Torch's path with oneDNN as it is against oneDNN capped below AMX (child processes)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from pagedkv.bench.machine import cpu_name

    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    print(f"CPU: {cpu_name()}; AMX: {amx}; load {os.getloadavg()[0]:.1f}; torch's path "
          f"(SDPA flash), bfloat16, {HEADS}/{KV_HEADS} heads x 64, best of {args.reps}")
    for threads in map(int, args.threads.split(",")):
        runs = {}
        for label, isa in (("as is", None), ("no AMX", NO_AMX)):
            env = dict(os.environ)
            env.pop("ONEDNN_MAX_CPU_ISA", None)
            if isa:
                env["ONEDNN_MAX_CPU_ISA"] = isa
            cmd = [sys.executable, __file__, "--torch-times", str(threads), "--reps",
                   str(args.reps)]
            runs[label] = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True,
                                                    check=True).stdout.splitlines()[-1])
        for shape, ms in runs["as is"].items():
            print(f"  {threads} thread(s) {shape:>14}: {ms:8.3f} ms, capped at {NO_AMX}: "
                  f"{runs['no AMX'][shape]:8.3f} ms ({runs['no AMX'][shape] / ms:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--amx-compare", action="store_true")
    parser.add_argument("--threads", default="1,2", help="--amx-compare's thread counts")
    parser.add_argument("--torch-times", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_times:
        import json

        print(json.dumps(torch_times(args.torch_times, args.reps)))
        return 0
    if args.amx_compare:
        amx_compare(args)
        return 0
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
            from pagedkv.model.prefill_choice import measure_prefill

            start = measure_prefill(dtype, HEADS, KV_HEADS, d, BLOCK)
            print(f"{name:<10}{d:>4}  measured choice: torch's from {start.fresh} tokens fresh, "
                  f"from {start.after_prefix} after a prefix (None: never)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
