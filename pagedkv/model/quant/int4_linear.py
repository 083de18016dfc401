"""A linear layer on 4-bit weights kept packed (GGUF Q4_0, Q4_1, Q4_K): weight = (code - 8) *
scale + zero per group of 32 along each row (int4_blocks.py).

The codes (4 bits a weight) and each group's scale and zero (bfloat16), one copy:
- a decode-sized call (rows <= `GEMV_ROWS`) with the fused CPU kernels loaded runs their
  `int4_gemv` (kernels/csrc/quant_int4.cpp): the activations quantized to int16 per group of
  32 once per call, integer dot products on the packed codes (AVX-512 VNNI, or AVX2), as
  llama.cpp computes its Q4 x Q8 products but with 16-bit activations (8-bit ones flip close
  greedy choices); it reads 0.625 bytes a weight (benchmarks/
  bench_quant_linear.py: `int4gemv` against torch's int4 kernel and oneDNN's bfloat16 linear);
- a larger call, or any call before the kernels load, expands the codes to a dense weight in the
  activation dtype (`int4_expand`; torch ops without the kernels) and runs the dense matmul
  (oneDNN's; a prefill of hundreds of rows is compute-bound, where its bfloat16 or AMX
  kernels win by 5-10x over an int4 kernel).
Both compute on the same weights (the bfloat16 scales and zeros). The decode-sized path rounds
the activations to int16 steps of their group's max / 32767 for the codes' term (the zeros'
term takes the exact sums): finer than the bfloat16 rounding a 16-bit model's activations
already have.
The tensors are parameters (requires_grad False), so the model's parameter bytes count them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.kernels.cpu import cpu_kernels_loaded
from pagedkv.model.quant.int4_blocks import GROUP

_EXPAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Rows up to which `int4_gemv` runs. Against expanding the weight and then the dense matmul (the
# alternative), it wins up to about 16 rows (SmolLM2's 576x1536 down, one thread: 0.20 against
# 0.25 ms at 12 rows, 0.27 against 0.25 at 16; the 3072x576 gate_up: 0.49 against 0.70 at 12).
GEMV_ROWS = 12


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Int4Linear(nn.Module):
    """y = x W^T (+ bias) with W [out_features, in_features] in 4-bit groups of 32."""

    def __init__(self, nibbles: np.ndarray, scale: np.ndarray, zero: np.ndarray,
                 bias: torch.Tensor | None = None) -> None:
        """`nibbles` uint8 [N, K/2] (Q4_0 order), `scale` and `zero` float32 [N, K/32]
        (int4_blocks.codes_and_scales). ValueError when K is not a multiple of 32."""
        super().__init__()
        n, half_k = nibbles.shape
        self.out_features, self.in_features = n, 2 * half_k
        if self.in_features % GROUP:
            raise ValueError(f"Int4Linear: weight [{n}, {self.in_features}] needs columns a "
                             f"multiple of {GROUP}")
        self.nibbles = _param(torch.from_numpy(np.ascontiguousarray(nibbles)))
        sz = np.stack((scale, zero), axis=-1)  # [N, K/32, 2]
        self.scale_zero = _param(torch.from_numpy(np.ascontiguousarray(sz)).bfloat16())
        self.bias = None if bias is None else _param(bias.detach().clone())

    def pack(self, panels: bool = False) -> bool:
        """Nothing to prepare (the weight is packed at build); the model's `pack` calls."""
        return True

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype` (each value rounded once from float32): the fused CPU kernels'
        `int4_expand` when they are loaded (kernels/csrc/quant_int4.cpp), else torch ops."""
        if cpu_kernels_loaded() and dtype in _EXPAND_DTYPES:
            return torch.ops.pagedkv_cpu.int4_expand(self.nibbles, self.scale_zero, dtype)
        return self.dequantized_reference(dtype)

    def dequantized_reference(self, dtype: torch.dtype) -> torch.Tensor:
        """`dequantized` in torch ops (the reference the kernel is tested against)."""
        n = self.out_features
        blocks = self.nibbles.view(n, -1, 16)
        codes = torch.cat((blocks & 15, blocks >> 4), dim=2).float()  # [N, K/32, 32]
        scale_zero = self.scale_zero.float()  # [N, K/32, 2]
        scale, zero = scale_zero[..., :1], scale_zero[..., 1:]
        return torch.addcmul(zero - 8 * scale, codes, scale).reshape(n, -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= GEMV_ROWS and rows.dtype in _EXPAND_DTYPES and cpu_kernels_loaded():
            y = torch.ops.pagedkv_cpu.int4_gemv(rows.contiguous(), self.nibbles, self.scale_zero,
                                                self.bias)
        else:
            y = F.linear(rows, self.dequantized(x.dtype),
                         None if self.bias is None else self.bias.to(x.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group 32"
