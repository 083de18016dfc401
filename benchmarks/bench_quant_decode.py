"""Decode attention over quantized KV blocks read in place vs over bfloat16 blocks (issue 25).

The fused CPU kernel (`torch.ops.pagedkv_cpu.paged_decode_attention_q`) attends `--batch`
single-token decodes at `--context` tokens each (default 32 x 4096: 128 MiB of bfloat16 K/V per
layer-sized call, far past the L3 cache, as a long-context decode step reads it) over blocks
stored as bfloat16 (the baseline, a bfloat16 model's own cache), float32, int8 (per-token
scales) and fp8 e4m3 / e5m2, queries in bfloat16; the benchmark model's heads (8 query heads,
4 KV heads of 64), block size 16, physical blocks shuffled. Calls of every format are
interleaved round-robin so all see the same machine load; each format's best time per round,
and per round the bfloat16 / format ratio (> 1: faster than bfloat16). Prints the ratio range
over `--rounds` rounds.

    PYTHONPATH=. python benchmarks/bench_quant_decode.py [--context 4096] [--batch 32]
        [--threads 2] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.kv_int8 import quantize_per_token
from pagedkv.model.kv_quant import quantize

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16
FORMATS = ("bfloat16", "float32", "int8", "fp8_e4m3", "fp8_e5m2")


def make_caches(batch: int, context: int, gen: torch.Generator) -> dict:
    """Per format: (k_cache, v_cache, k_scales, v_scales) of the same random K/V."""
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    shape = (KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    out = {"bfloat16": (k.bfloat16(), v.bfloat16(), None, None), "float32": (k, v, None, None)}
    (k8, ks), (v8, vs) = quantize_per_token(k), quantize_per_token(v)
    out["int8"] = (k8, v8, ks, vs)
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        out[name] = (quantize(k, dtype), quantize(v, dtype), None, None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5, help="calls per format per round")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ensure_cpu_kernels("wait")
    gen = torch.Generator().manual_seed(0)
    caches = make_caches(args.batch, args.context, gen)
    per_seq = -(-args.context // BLOCK)
    perm = torch.randperm(args.batch * per_seq, generator=gen) + 1
    tables = perm.view(args.batch, per_seq)
    lens = torch.full((args.batch,), args.context, dtype=torch.long)
    first = torch.zeros(args.batch, dtype=torch.long)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen).bfloat16()

    def call(name: str) -> None:
        k, v, ks, vs = caches[name]
        qq = q.float() if name == "float32" else q
        torch.ops.pagedkv_cpu.paged_decode_attention_q(qq, k, v, ks, vs, tables, first, lens,
                                                       HEAD_DIM ** -0.5, torch.empty_like(qq),
                                                       None)

    for name in FORMATS:
        call(name)  # warm-up
    rounds = []
    for _ in range(args.rounds):
        best = {name: float("inf") for name in FORMATS}
        for _ in range(args.iters):
            for name in FORMATS:
                t = time.perf_counter()
                call(name)
                best[name] = min(best[name], time.perf_counter() - t)
        rounds.append(best)
    report = {"context": args.context, "batch": args.batch, "threads": torch.get_num_threads(),
              "bytes_per_call": {n: sum(t.nbytes for t in c if t is not None)
                                 for n, c in caches.items()},
              "rounds": rounds}
    for name in FORMATS:
        ratios = [r["bfloat16"] / r[name] for r in rounds]
        ms = [1e3 * r[name] for r in rounds]
        report.setdefault("bf16_over_format", {})[name] = [min(ratios), max(ratios)]
        print(f"{name:>9}: {min(ms):7.2f}-{max(ms):7.2f} ms per call "
              f"({report['bytes_per_call'][name] / 2**20:.0f} MiB), bfloat16 time / this "
              f"{min(ratios):.2f}-{max(ratios):.2f}x", flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
