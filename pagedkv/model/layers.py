"""Building blocks of the Llama family: RMSNorm, rotary embeddings (default, linear, llama3), MLP.

Numerics follow transformers' implementations (RMSNorm in float32, RoPE angles in float32 then
cast to the activation dtype) so float32 results match to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for RoPE with optional linear/llama3 scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table that grows on demand."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 max_positions: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._table_len = 0
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._max_positions = max_positions

    def _table(self, needed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or needed > self._table_len or self._cos.dtype != dtype:
            n = max(needed, self._max_positions, self._table_len)
            pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin, self._table_len = emb.cos().to(dtype), emb.sin().to(dtype), n
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for `positions` [T] (valid until the next call that grows the table)."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self._table(needed, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, 1, head_dim] (returns a new tensor)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
