"""The int8-block linear (GGUF Q8_0 / Q6_K kept packed) on this CPU against the dense bfloat16
one, by shape and rows: where its integer kernel beats expanding the weight first.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_int8_blocks.py [--rows 1,2,4,8,16,32,64]
        [--block 32] [--budget 0.2]

Paths (weight [N, K] of SmolLM2-135M's linears and tied head, activations [rows, K] bfloat16):
- `int8`: `int8_block_linear` (kernels/csrc/quant_int8.cpp: activations quantized per block,
  VNNI / AVX2 integer dots), reading about 1.1 bytes a weight;
- `expand`: Int8BlockLinear's path above `INT8_BLOCK_ROWS` (the weight expanded to bfloat16 a
  chunk at a time, then oneDNN's matmul);
- `bf16`: oneDNN's pre-packed bfloat16 linear on the dense weight (2 bytes a weight).
A cell is the fastest call's thread CPU time within `--budget` seconds, one thread (a shared
machine's other processes left out; the load average is printed): ratios within one run only.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.layers import pack_onednn
from pagedkv.model.quant.int8_block_linear import Int8BlockLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def fastest_ms(call: Callable[[], object], budget_s: float) -> float:
    """The fastest of repeated calls (thread CPU time, ms) within `budget_s` of wall time."""
    call()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < budget_s:
        t0 = time.thread_time()
        call()
        best = min(best, time.thread_time() - t0)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--block", type=int, default=32, choices=(16, 32))
    parser.add_argument("--budget", type=float, default=0.2)
    args = parser.parse_args()
    assert ensure_cpu_kernels("wait")
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()}")
    for n, k in SHAPES:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        linear = Int8BlockLinear(codes, torch.rand(n, k // args.block) * 1e-2)
        packed = pack_onednn(linear.dequantized(torch.bfloat16))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            calls = {
                "int8": partial(torch.ops.pagedkv_cpu.int8_block_linear, x, linear.codes,
                                linear.scales, linear.block),
                "expand": partial(linear._expanded_linear, x, None),
                "bf16": partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none",
                                [], ""),
            }
            cells = {name: fastest_ms(call, args.budget) for name, call in calls.items()}
            print(f"{n}x{k} rows {rows:3d}: " + "  ".join(
                f"{name} {ms:.3f} ms ({cells['bf16'] / ms:.2f}x bf16)"
                for name, ms in cells.items()), flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
