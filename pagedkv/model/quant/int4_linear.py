"""A linear layer on 4-bit weights kept packed (GGUF Q4_0, Q4_1, Q4_K): weight = (code - 8) *
scale + zero per group of 32 along each row (int4_blocks.py).

Two copies of the codes, both 4 bits a weight, and one of the scales (bfloat16):
- a decode-sized call (rows <= `INT4PACK_ROWS`) runs torch's `_weight_int4pack_mm_for_cpu` on
  torch's own packed layout (it reads 0.56 bytes a weight; about 1.5-2.9x oneDNN's bfloat16
  linear at one row on an AVX-512 CPU, slower from 8 rows: benchmarks/bench_quant_linear.py;
  the fused kernels' own int4 product, `int4_gemv`, measured on par with it at one row and
  slower from four (`--cold`: SmolLM2's shapes, one thread, 3.12 against 3.71 ms summed at one
  row, 5.33 against 4.69 at four; about 1.4x slower at one row on a busy machine), so it stays
  out of this path);
- a larger call expands the codes (Q4_0 order) to a dense weight in the activation dtype
  (`int4_expand`, kernels/csrc/quant_int4.cpp; torch ops before the kernels load) and runs the
  dense matmul (oneDNN's; a prefill of hundreds of rows is compute-bound, where its bfloat16 or AMX
  kernels win by 5-10x over the int4 kernel).
Both compute on the same weights (the bfloat16 scales and zeros), so a request's tokens do not
depend on which path a step took beyond float summation order. Activations of another dtype are
rounded to bfloat16 for the int4 kernel (its float32 path is 10-60x slower).
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

# Rows up to which the int4 kernel runs. Against the dense bfloat16 matmul it wins 1.5-2.9x at 1
# row, breaks even at about 8 and is 5-13x slower at 64-512 rows (benchmarks/
# bench_quant_linear.py); against expanding the weight first and then the dense matmul (what
# the packed layer's alternative is), it wins up to about 12 rows and loses from 16 (SmolLM2's
# 3072x576 gate_up, one thread: 0.51 against 0.69 ms at 12 rows, 0.69 against 0.65 at 16).
INT4PACK_ROWS = 12


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Int4Linear(nn.Module):
    """y = x W^T (+ bias) with W [out_features, in_features] in 4-bit groups of 32."""

    def __init__(self, nibbles: np.ndarray, scale: np.ndarray, zero: np.ndarray,
                 bias: torch.Tensor | None = None) -> None:
        """`nibbles` uint8 [N, K/2] (Q4_0 order), `scale` and `zero` float32 [N, K/32]
        (int4_blocks.codes_and_scales). ValueError when N is not a multiple of 16 or K of 32
        (what the int4 kernel takes)."""
        super().__init__()
        n, half_k = nibbles.shape
        self.out_features, self.in_features = n, 2 * half_k
        if n % 16 or self.in_features % GROUP:
            raise ValueError(f"Int4Linear: weight [{n}, {self.in_features}] needs rows a "
                             f"multiple of 16 and columns a multiple of {GROUP}")
        nib = torch.from_numpy(np.ascontiguousarray(nibbles))
        blocks = nib.view(n, -1, 16)
        codes = torch.cat((blocks & 15, blocks >> 4), dim=2).view(n, -1).to(torch.int32)
        self.int4pack = _param(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.nibbles = _param(nib)
        sz = np.stack((scale, zero), axis=-1).transpose(1, 0, 2)  # [K/32, N, 2]
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
        scale_zero = self.scale_zero.float().transpose(0, 1)  # [N, K/32, 2]
        scale, zero = scale_zero[..., :1], scale_zero[..., 1:]
        return torch.addcmul(zero - 8 * scale, codes, scale).reshape(n, -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= INT4PACK_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(torch.bfloat16).contiguous(), self.int4pack, GROUP,
                self.scale_zero).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        else:
            y = F.linear(rows, self.dequantized(x.dtype),
                         None if self.bias is None else self.bias.to(x.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group 32"
