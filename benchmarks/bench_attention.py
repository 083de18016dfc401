"""Paged attention vs dense SDPA on the same K/V laid out contiguously.

Decode: `--batch` requests (default 32), one query token each, every request with the same
context length (plus one "decode-mixed" row: lengths drawn from [max/16, max], dense padded to the
longest with a mask, and one "decode-shared" row: every request's first max - 64 tokens are the
same physical blocks, as after prefix-cache hits, which paged attention reads once (cascade
attention) while dense SDPA reads each request's copy); prefill: `--prefill-batch` requests (default 8), each a chunk of
`--chunk` new tokens (default 128) on top of a cached prefix, so the whole context is the
given length. 8 query heads, 2 KV heads, head size 64, block size 16, physical blocks shuffled.
Dense baseline: torch.nn.functional.scaled_dot_product_attention on [B, heads, L, D]
contiguous tensors (enable_gqa), with a causal bool mask for prefill.
Prints time per call and the paged/dense ratio (target <= 1.5); `--json` prints JSON instead.

    .venv/bin/python benchmarks/bench_attention.py [--json] [--contexts 128 512 2048] [--threads 1]

On a machine shared with other busy processes, `--threads 1` gives the stable figures: with
several threads every small parallel op can wait for a descheduled thread.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn import functional as F

from pagedkv.model.attention import (
    AttentionMetadata,
    PrefillChunk,
    decode_attention,
    prefill_attention,
)

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def timeit_pair(fn_a, fn_b, min_time: float = 0.4, max_iters: int = 40) -> tuple[float, float]:
    """Best time per call of each, calls interleaved so both see the same machine load (the
    minimum is the least disturbed figure on a shared machine)."""
    fn_a(), fn_b()  # warm-up
    ta, tb = [], []
    start = time.perf_counter()
    while len(ta) < max_iters and (time.perf_counter() - start < min_time or len(ta) < 5):
        for fn, times in ((fn_a, ta), (fn_b, tb)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return min(ta), min(tb)


def make_paged(batch: int, ctx: int, block_size: int, dtype: torch.dtype, gen: torch.Generator):
    """Dense K/V [B, KVH, ctx, D] and the same data scattered into shuffled cache blocks."""
    k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, generator=gen).to(dtype)
    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = batch * blocks_per_seq + 1
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_seq)
    k_cache = torch.zeros(KV_HEADS, num_blocks, block_size, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    pad = blocks_per_seq * block_size - ctx
    # [B, KVH, ctx, D] -> [KVH, B, blocks, block_size, D]
    kt = F.pad(k, (0, 0, 0, pad)).transpose(0, 1).reshape(KV_HEADS, batch, blocks_per_seq,
                                                           block_size, HEAD_DIM)
    vt = F.pad(v, (0, 0, 0, pad)).transpose(0, 1).reshape(KV_HEADS, batch, blocks_per_seq,
                                                           block_size, HEAD_DIM)
    k_cache[:, perm] = kt
    v_cache[:, perm] = vt
    return k, v, k_cache, v_cache, perm


def bench_decode(batch: int, ctx: int, dtype: torch.dtype, block_size: int = 16,
                 mixed: bool = False, shared: int = 0) -> dict:
    """`mixed`: request i has a random length in [ctx // 16, ctx]; dense pads to ctx with a mask.
    `shared`: the first `shared` tokens (whole blocks) of every request are request 0's blocks."""
    gen = torch.Generator().manual_seed(0)
    k, v, k_cache, v_cache, tables = make_paged(batch, ctx, block_size, dtype, gen)
    if shared:
        nb = shared // block_size
        tables[1:, :nb] = tables[0, :nb]
        k[1:, :, :nb * block_size] = k[0, :, :nb * block_size]
        v[1:, :, :nb * block_size] = v[0, :, :nb * block_size]
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5
    lens = (torch.randint(ctx // 16, ctx + 1, (batch,), generator=gen) if mixed
            else torch.full((batch,), ctx))
    mask = (torch.arange(ctx)[None, :] < lens[:, None])[:, None, None, :] if mixed else None
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=batch,
                             decode_seq_lens=lens, decode_block_tables=tables,
                             prefills=[], block_size=block_size,
                             decode_seq_lens_list=lens.tolist())

    def dense():
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    def paged():
        return decode_attention(q, k_cache, v_cache, meta, scale, None)

    err = (paged().float() - dense().squeeze(2).float()).abs().max().item()
    td, tp = timeit_pair(dense, paged)
    kind = "decode-mixed" if mixed else "decode-shared" if shared else "decode"
    return {"kind": kind, "dtype": str(dtype).removeprefix("torch."),
            "batch": batch, "context": ctx, "dense_ms": td * 1e3, "paged_ms": tp * 1e3,
            "ratio": tp / td, "max_abs_err": err}


def bench_prefill(batch: int, ctx: int, chunk: int, dtype: torch.dtype,
                  block_size: int = 16) -> dict:
    gen = torch.Generator().manual_seed(1)
    chunk = min(chunk, ctx)
    k, v, k_cache, v_cache, tables = make_paged(batch, ctx, block_size, dtype, gen)
    q = torch.randn(batch, HEADS, chunk, HEAD_DIM, generator=gen).to(dtype)
    start = ctx - chunk
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
    scale = HEAD_DIM ** -0.5
    chunks = [PrefillChunk(0, chunk, start, ctx, tables[b]) for b in range(batch)]
    q_tok = q.permute(0, 2, 1, 3).contiguous()  # [B, chunk, H, D]
    k_new = k[:, :, start:].permute(0, 2, 1, 3).contiguous()
    v_new = v[:, :, start:].permute(0, 2, 1, 3).contiguous()

    def dense():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def paged():
        return [prefill_attention(q_tok[b], k_new[b], v_new[b], k_cache, v_cache, chunks[b],
                                  scale, None) for b in range(batch)]

    ref = dense()
    err = max((p.float() - ref[b].transpose(0, 1).float()).abs().max().item()
              for b, p in enumerate(paged()))
    td, tp = timeit_pair(dense, paged)
    return {"kind": "prefill", "dtype": str(dtype).removeprefix("torch."), "batch": batch,
            "context": ctx, "chunk": chunk, "dense_ms": td * 1e3, "paged_ms": tp * 1e3,
            "ratio": tp / td, "max_abs_err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name in args.dtypes:
            dtype = getattr(torch, name)
            for ctx in args.contexts:
                rows.append(bench_decode(args.batch, ctx, dtype))
                if not args.json:
                    _print_row(rows[-1])
            rows.append(bench_decode(args.batch, max(args.contexts), dtype, mixed=True))
            if not args.json:
                _print_row(rows[-1])
            longest = max(args.contexts)
            rows.append(bench_decode(args.batch, longest, dtype, shared=max(0, longest - 64)))
            if not args.json:
                _print_row(rows[-1])
            for ctx in args.contexts:
                rows.append(bench_prefill(args.prefill_batch, ctx, args.chunk, dtype))
                if not args.json:
                    _print_row(rows[-1])
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        worst = max(r["ratio"] for r in rows if r["kind"] != "decode-shared")
        print(f"worst paged/dense ratio (decode-shared aside): {worst:.2f} (target <= 1.5) on "
              f"{torch.get_num_threads()} threads")


def _print_row(r: dict) -> None:
    extra = f" chunk={r['chunk']}" if "chunk" in r else ""
    print(f"{r['kind']:12s} {r['dtype']:8s} batch={r['batch']:<3d} ctx={r['context']:<5d}{extra:10s} "
          f"dense {r['dense_ms']:8.3f} ms  paged {r['paged_ms']:8.3f} ms  ratio {r['ratio']:.2f}  "
          f"err {r['max_abs_err']:.1e}", flush=True)


if __name__ == "__main__":
    main()
