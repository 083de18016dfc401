"""Packed-weight linears on this CPU against the dense bfloat16 one, by shape and rows.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_quant_linear.py [--rows 1,8,64,512]
        [--shapes smollm2,llama7b] [--threads N] [--budget 0.15] [--cold]

Paths (each weight [N, K], activations [rows, K]):
- `bf16`: oneDNN's pre-packed bfloat16 linear (the model's dense path: layers.pack_onednn);
- `f32`: oneDNN's pre-packed float32 linear;
- `int8pack`: `aten._weight_int8pack_mm` (int8 per-channel weights, bfloat16 activations);
- `int4pack`: `aten._weight_int4pack_mm_for_cpu` (int4, group 32, a scale and a zero per group:
  GGUF Q4_0 / Q4_1 exactly), bfloat16 activations (on float32 activations the same op is
  10-60x slower than on bfloat16 ones in torch 2.13: left out);
- `int_mm`: `torch._int_mm` on int8 activations quantized per row at the call (W8A8, the
  activation quantization counted), per-channel int8 weights;
- `int4gemv`: pagedkv's `int4_gemv` (kernels/csrc/quant_int4.cpp; the packed linear's decode
  path: the same int4 weights with float16 scales and offsets, activations quantized to int8
  per group of 32 at the call, counted; from 4 rows on AVX-512 VNNI the panel product);
- `q40`: `int4_gemv` on Q4_0's layout, its float16 scales alone (offsets -8 x scale, implied:
  the model's layout for Q4_0 files);
- `int8gemv`: pagedkv's `int8_gemv` (the LM head's copy: int8 per-row weights, int16
  activations per row);
- `int4expand`: the packed linear's path beyond decode sizes (`int4_linear` with no rows on the
  product: the weight expanded to bfloat16 a chunk at a time, then oneDNN's matmul);
- `q8gemv`, `q8expand`: the GGUF Q8_0 linear's two paths (`int8_block_forward`: the product on
  int8 activations per block of 32, or the expanded weight);
- `q4k`, `q4k2` (where K is a multiple of 256): a Q4_K weight (random blocks) as Int4Linear with
  its scales as a float32 table of their products, or as the file's two levels (fp16 d and
  -dmin per 256, 6-bit sub-scales and mins per 32: `Int4Linear.from_two_level`), the same
  products; `q6k`, `q6k2`, `q6k6` likewise a Q6_K weight as Int8BlockLinear with a float32
  scale per 16, or the file's two levels (fp16 d per 256, int8 sub-scales per 16:
  `int8_blocks.q6_k_two_level`), or those with the codes in 6 bits (`packed_codes`: the
  model's layout, the file's bytes); `q5k2` a Q5_K weight as the two-level Int4Linear with
  5-bit codes (the nibbles, then a fifth bit a code: `int4_blocks.pack_group_codes`).
Where `int4gemv` and `int4expand` (and `q8gemv`, `q8expand`) cross is where Int4Linear's
`product_rows` (`int4_tile_rows()` where the panel product or AMX tiles run, else `GEMV_ROWS`;
Int8BlockLinear's likewise) belongs: `--rows 1,4,8,16,24,32,48,64` (and `--rows 256,512,2048`
for prefills: the panel product runs every call where it is compiled).
`--cold` cycles each path's calls over copies of the weights, 2^24 weights in all (32 MiB in
bfloat16): a decode step reads each weight once, from the L3 cache or memory, not from the L2
cache a repeated call leaves it in.
A cell's time is the fastest of repeated calls within `--budget` seconds (paths interleaved, so
a busy moment hits them alike). Prints ms per call, each path's speed ratio to `bf16` (above 1:
faster) and the weight bytes a call reads. With `--threads 1` (the default) a call's time is
this thread's CPU time, which leaves out the time other processes held the core; the load average is printed first and last (the
machine may be shared: ratios within one run only).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.layers import pack_onednn

SHAPES = {
    # [N, K] of SmolLM2-135M's linears: qkv, o, gate_up, down, the tied lm_head.
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    # Llama-7B-like: q (and o), gate (and up), down.
    "llama7b": [(4096, 4096), (11008, 4096), (4096, 11008)],
    # Llama 3.2 1B-like, fused as pagedkv runs it: qkv, o, gate_up, down.
    "llama1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}
GROUP = 32


def _bytes(path: str, n: int, k: int) -> int:
    """Weight bytes one call reads (scales included)."""
    return {"bf16": 2 * n * k, "f32": 4 * n * k, "int8pack": n * k + 2 * n,
            "int_mm": n * k + 4 * n, "int8gemv": n * k + 2 * n,
            "int4gemv": n * k // 2 + n * k // GROUP * 4, "q40": n * k // 2 + n * k // GROUP * 2,
            "int4expand": n * k // 2 + n * k // GROUP * 4,
            "q8gemv": n * k + n * k // GROUP * 4, "q8expand": n * k + n * k // GROUP * 4,
            "int4pack": n * k // 2 + n * k // GROUP * 4, "q4k": n * k // 2 + n * k // GROUP * 8,
            "q4k2": n * k // 2 + n * k // GROUP * 5 // 2,
            "q5k2": n * k * 5 // 8 + n * k // GROUP * 5 // 2, "q6k": n * k + n * k // 16 * 4,
            "q6k2": n * k + n * k // 16 + n * k // 128,
            "q6k6": n * k * 3 // 4 + n * k // 16 + n * k // 128}[path]


def _paths(n: int, k: int) -> dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], object]]]:
    """{path: (its activation, the call)} for one random weight [n, k]."""
    w = torch.randn(n, k) * 0.02
    xb = torch.randn(1, k).bfloat16()
    pb, pf = pack_onednn(w.bfloat16()), pack_onednn(w)
    scale8 = w.abs().amax(1) / 127
    w8 = torch.round(w / scale8[:, None]).to(torch.int8)
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    p4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.rand(k // GROUP, n, 2) * 0.01
    w8t = w8.t().contiguous()
    q8s = torch.rand(n, k // GROUP) * 0.01  # Q8_0: a float32 scale per block of 32
    nib = (q4[:, 0::2] | (q4[:, 1::2] << 4)).to(torch.uint8)  # any order: the same bytes
    scales = sz.permute(1, 2, 0).reshape(n, -1).half().contiguous()  # [N, 2 * K/32]
    scale_only = scales[:, : k // GROUP].contiguous()  # Q4_0's: offsets implied (-8 x scale)
    ops = torch.ops.pagedkv_cpu

    def int_mm(x: torch.Tensor) -> torch.Tensor:
        xs = x.float().abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
        xq = torch.round(x.float() / xs).to(torch.int8)
        if xq.shape[0] <= 16:  # _int_mm wants more than 16 rows
            xq = torch.nn.functional.pad(xq, (0, 0, 0, 17 - xq.shape[0]))
        return (torch._int_mm(xq, w8t)[: x.shape[0]].float() * xs * scale8).bfloat16()

    lp = torch.ops.mkldnn._linear_pointwise
    q4k = _k_quant_linears(n, k) if k % 256 == 0 else {}
    return {**{name: (xb, linear) for name, linear in q4k.items()},
        "bf16": (xb, lambda x: lp(x, pb, None, "none", [], "")),
        "f32": (xb.float(), lambda x: lp(x, pf, None, "none", [], "")),
        "int8pack": (xb, lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, scale8.bfloat16())),
        "int4pack": (xb, lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, p4, GROUP, sz.bfloat16())),
        "int_mm": (xb, int_mm),
        "int4gemv": (xb, lambda x: ops.int4_gemv(x, nib, scales, None)),
        "q40": (xb, lambda x: ops.int4_gemv(x, nib, scale_only, None)),
        "int8gemv": (xb, lambda x: ops.int8_gemv(x, w8, scale8.bfloat16(), None)),
        "int4expand": (xb, lambda x: ops.int4_linear(x, nib, scales, None, 0)),
        "q8gemv": (xb, lambda x: ops.int8_block_forward(x, w8, q8s, 32, None, 1 << 30)),
        "q8expand": (xb, lambda x: ops.int8_block_forward(x, w8, q8s, 32, None, 0)),
    }


def _k_quant_linears(n: int, k: int) -> dict[str, torch.nn.Module]:
    """{"q4k": the float32-table Int4Linear, "q4k2": the two-level one} of random Q4_K blocks
    [n, k] (fp16 d and dmin between 1e-3 and 1e-2), "q5k2" of Q5_K blocks alike, and "q6k",
    "q6k2", "q6k6" of Q6_K blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from pagedkv.model.quant.int4_blocks import codes_and_scales, k_quant_two_level
    from pagedkv.model.quant.int4_linear import Int4Linear
    from pagedkv.model.quant.int8_block_linear import Int8BlockLinear
    from pagedkv.model.quant.int8_blocks import (
        int8_codes_and_scales,
        packed_codes,
        q6_k_two_level,
    )

    rng = np.random.default_rng(n + k)
    raw = rng.integers(0, 256, (n * k // 256, 144), dtype=np.uint8)
    raw[:, 0:4] = rng.uniform(1e-3, 1e-2, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    raw5 = rng.integers(0, 256, (n * k // 256, 176), dtype=np.uint8)
    raw5[:, 0:4] = rng.uniform(1e-3, 1e-2, (raw5.shape[0], 2)).astype(np.float16).view(np.uint8)
    raw5 = raw5.reshape(n, -1)
    raw6 = rng.integers(0, 256, (n * k // 256, 210), dtype=np.uint8)
    raw6[:, 208:210] = rng.uniform(1e-3, 1e-2, (raw6.shape[0], 1)).astype(np.float16) \
        .view(np.uint8)
    raw6 = raw6.reshape(n, -1)
    codes6, scales6, _ = int8_codes_and_scales(raw6, GGMLQuantizationType.Q6_K)
    table6 = torch.from_numpy(q6_k_two_level(raw6)[1])
    return {"q4k": Int4Linear(*codes_and_scales(raw, GGMLQuantizationType.Q4_K)),
            "q4k2": Int4Linear.from_two_level(*k_quant_two_level(raw, GGMLQuantizationType.Q4_K)),
            "q5k2": Int4Linear.from_two_level(*k_quant_two_level(raw5,
                                                                 GGMLQuantizationType.Q5_K)),
            "q6k": Int8BlockLinear(torch.from_numpy(codes6), torch.from_numpy(scales6)),
            "q6k2": Int8BlockLinear(torch.from_numpy(codes6), table6),
            "q6k6": Int8BlockLinear(torch.from_numpy(packed_codes(codes6, 6)), table6)}


def _cold_paths(n: int, k: int, copies: int) -> dict[str, tuple[torch.Tensor, Callable]]:
    """Each path's call cycling over `copies` weights [n, k] of its own (cold caches)."""
    sets = [_paths(n, k) for _ in range(copies)]
    turn = [0]

    def cycle(name: str) -> Callable:
        def call(x: torch.Tensor) -> object:
            turn[0] += 1
            return sets[turn[0] % copies][name][1](x)
        return call

    return {name: (x, cycle(name)) for name, (x, _) in sets[0].items()}


def measure(n: int, k: int, rows: int, budget: float, cold: bool = False,
            only: set[str] | None = None) -> dict[str, float]:
    """{path: fastest call in ms} for weight [n, k] at `rows` rows (`cold`: over copies of the
    weights, 2^24 weights in all, one copy a call in turn; `only`: those paths and bf16)."""
    paths = _cold_paths(n, k, max(2, 2**24 // (n * k))) if cold else _paths(n, k)
    if only:
        paths = {name: p for name, p in paths.items() if name in only or name == "bf16"}
    xs = {name: x.expand(rows, k).contiguous() + 0.01 * torch.randn(rows, k).to(x.dtype)
          for name, (x, _) in paths.items()}
    best = dict.fromkeys(paths, float("inf"))
    for name, (_, fn) in paths.items():
        fn(xs[name])
    # One thread computes in this thread: its CPU time leaves out other processes' time.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    deadline = time.perf_counter() + budget
    rounds = 0
    while time.perf_counter() < deadline or rounds < 2:
        for name, (_, fn) in paths.items():
            start = clock()
            fn(xs[name])
            best[name] = min(best[name], clock() - start)
        rounds += 1
    return {name: 1e3 * t for name, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--shapes", default="smollm2,llama7b")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=float, default=0.15, help="seconds per cell")
    parser.add_argument("--cold", action="store_true", help="weights read from memory")
    parser.add_argument("--paths", default=None, help="comma-separated subset (bf16 always)")
    args = parser.parse_args()
    ensure_cpu_kernels("wait")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    totals: dict[tuple[str, int], dict[str, list[float]]] = {}
    for family in args.shapes.split(","):
        for n, k in SHAPES[family]:
            for rows in (int(r) for r in args.rows.split(",")):
                ms = measure(n, k, rows, args.budget, args.cold,
                             set(args.paths.split(",")) if args.paths else None)
                agg = totals.setdefault((family, rows), {})
                for name, t in ms.items():
                    agg.setdefault(name, []).append(t)
                cells = "  ".join(f"{name} {t:7.3f}ms x{ms['bf16'] / t:4.2f} "
                                  f"{_bytes(name, n, k) / 2**20:6.2f}MiB"
                                  for name, t in ms.items())
                print(f"{family:8s} {n:6d}x{k:<6d} rows {rows:4d}: {cells}", flush=True)
    print("\nsum over each family's shapes (ms; speed ratio to bf16; a path some shapes lack, as "
          "q4k where K is not a multiple of 256, left out):")
    for (family, rows), agg in totals.items():
        sums = {name: sum(ts) for name, ts in agg.items() if len(ts) == len(SHAPES[family])}
        print(f"{family:8s} rows {rows:4d}: " + "  ".join(
            f"{name} {t:8.3f} x{sums['bf16'] / t:4.2f}" for name, t in sums.items()))
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
