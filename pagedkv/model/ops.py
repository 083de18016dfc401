"""LayerOps: a decoder layer's elementwise steps, the reference torch code and the fused kernels.

The steps: RMSNorm, the residual add fused with the next RMSNorm (vLLM's fused_add_rms_norm),
SiLU-and-mul and RoPE. Which implementation runs:
- CUDA tensors: the Triton kernels of fused_ops.py (RMSNorm, SiLU-and-mul);
- CPU tensors, when `cpu_fused` is set: the C++ kernels of pagedkv/kernels (one pass over
  the activations each, parallel over rows);
- otherwise the reference torch code in layers.py, which rounds as transformers does; the fused
  versions round at the same points (tests/model/test_cpu_kernels.py compares them).

One LayerOps is shared by every layer of one model (the model owns it), so two engines in one
process choose independently. `cpu_fused` is flipped by the runner between steps, never during
a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class RopeInputs:
    """The step's RoPE inputs: `positions` [T] and the model's cos / signed-sin tables
    [max_positions, head_dim] (layers.RotaryEmbedding); `cos`, `sin` [T, 1, head_dim] are the
    rows at `positions`, gathered only when the reference path asks for them."""

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    _rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows is None:
            self._rows = (self.cos_table[self.positions].unsqueeze(1),
                          self.sin_table[self.positions].unsqueeze(1))
        return self._rows


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalised x (a new tensor), rounded as transformers' LlamaRMSNorm: statistics
    and scaling in float32, the weight applied in x's dtype."""
    h = x.float()
    scale = h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if h is x:  # float32: h aliases the input, so scale into a new tensor
        return (x * scale).mul_(weight)
    return h.mul_(scale).to(x.dtype).mul_(weight)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos / signed sin [T, 1, head_dim] (a new tensor; x may
    be a strided view): x * cos + swap_halves(x) * sin, transformers' rotate_half bit for bit
    (the sign of the first half lives in the table; a sign flip is exact)."""
    d = x.shape[-1]
    swapped = x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)  # [x2, x1], a new tensor
    return (x * cos).add_(swapped.mul_(sin))


class LayerOps:
    """The elementwise steps for one model; see the module docstring for who runs what."""

    def __init__(self) -> None:
        self.cpu_fused = False

    def _fused_cpu(self, x: torch.Tensor) -> bool:
        return self.cpu_fused and x.device.type == "cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * normalised x, a new tensor (x is not changed)."""
        if x.dim() == 2 and x.stride(-1) == 1:
            if x.is_cuda:
                from pagedkv.model.fused_ops import rms_norm

                return rms_norm(x, weight, eps)
            if self._fused_cpu(x):
                return torch.ops.pagedkv_cpu.rms_norm(x, weight, eps)
        return rms_norm_reference(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x (in place, residual's dtype); returns weight * normalised residual
        (a new tensor)."""
        if self._fused_cpu(x) and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
            return torch.ops.pagedkv_cpu.add_rms_norm_(x, residual, weight, eps)
        residual += x
        return self.rms_norm(residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 * I] = [gate | up] (a new [T, I] tensor)."""
        if gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            if gate_up.is_cuda:
                from pagedkv.model.fused_ops import silu_and_mul

                return silu_and_mul(gate_up)
            if self._fused_cpu(gate_up):
                return torch.ops.pagedkv_cpu.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def rope(self, x: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        """x [T, heads, head_dim] rotated: in place on the fused CPU path (x must then be a
        view whose heads are contiguous, e.g. a slice of the qkv projection), a new tensor
        otherwise. Use the returned tensor either way."""
        if (self._fused_cpu(x) and x.dim() == 3 and x.stride(2) == 1
                and x.stride(1) == x.shape[2] and rope.cos_table.dtype == x.dtype):
            torch.ops.pagedkv_cpu.rope_(x, rope.positions, rope.cos_table, rope.sin_table)
            return x
        cos, sin = rope.rows()
        return apply_rope_reference(x, cos, sin)
