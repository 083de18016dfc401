"""A linear layer on int8 weights with one scale per output channel (symmetric, vLLM's
`--quantization int8` for a checkpoint stored in 16 or 32 bits): each row's largest magnitude
maps to 127.

Decode-sized calls (rows <= `INT8PACK_ROWS`) run torch's `_weight_int8pack_mm` on the int8
weight (1.1-2.1x oneDNN's bfloat16 linear at one row on an AVX-512 CPU; slower from a few rows:
benchmarks/bench_quant_linear.py); larger ones expand the weight to the activation dtype and run
the dense matmul. Unlike the GGUF formats this rounds the checkpoint's weights (by at most half
a step of the row's scale).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

INT8PACK_ROWS = 1


def int8_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K], scales bfloat16 [N]) of `weight` [N, K]: each row's largest
    magnitude maps to 127, every weight rounded to the nearest code."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).to(torch.int8), scale.bfloat16()


class Int8Linear(nn.Module):
    """y = x W^T (+ bias), W [out_features, in_features] as int8 codes times a per-row scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantize `weight` [N, K] (any float dtype) per output row."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scale = int8_per_row(weight)
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)

    def pack(self, panels: bool = False) -> bool:
        """Nothing to prepare (the model's `pack` calls)."""
        return True

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype`: codes times the (bfloat16) scales, rounded once."""
        return (self.codes.float() * self.scale.float()[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if rows.shape[0] <= INT8PACK_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(),
                                                   self.codes, self.scale).to(x.dtype)
            y = y if bias is None else y + bias
        else:
            y = F.linear(rows, self.dequantized(x.dtype), bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
