"""The fused elementwise CPU kernels (RMSNorm, the residual add + RMSNorm, SiLU-and-mul, RoPE)
against float64, beside the torch reference they replace.

For each op and dtype the check returns the ratio of the kernel's worst error against a
float64 computation of the same op to the error bound of the torch reference's rounding:
`ratio <= 1` means the kernel is as close to exact as its dtype's reference path allows.
Sizes leave a scalar tail after whole registers (8 or 16 lanes), and rows are strided where
the layers pass strided rows. Runs in this process or in a child built for another
instruction set (isa_child.run_with_isa).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from pagedkv.kernels.cpu import ensure_cpu_kernels, panel_isa

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bound(ref: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> float:
    """The error bound a kernel must meet: twice the torch reference's own worst error against
    float64, plus one unit of the dtype's rounding at the values' scale (the two paths round
    at the same points, so their errors are of one size)."""
    ulp = torch.finfo(dtype).eps * float(exact.abs().max())
    return 2 * float((ref.double() - exact).abs().max()) + ulp


def _ratio(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor,
           dtype: torch.dtype) -> float:
    return float((got.double() - exact).abs().max()) / _bound(ref, exact, dtype)


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w.double()


def check_elementwise(seed: int = 0) -> dict:
    """{"isa": the build's panel path, "<op> <dtype>": worst ratio (see the module docstring)}."""
    from pagedkv.model.layers import RotaryEmbedding
    from pagedkv.model.ops import apply_rope_reference, rms_norm_reference

    assert ensure_cpu_kernels("wait")
    ops = torch.ops.pagedkv_cpu
    out: dict = {"isa": panel_isa()}
    gen = torch.Generator().manual_seed(seed)
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        base = torch.randn(37, 2 * 103, generator=gen).to(dtype)
        x = base[:, :103]  # rows strided, 103 = 6 * 16 + 7 values: a tail on both widths
        w = torch.randn(103, generator=gen).to(dtype)
        out[f"rms_norm {name}"] = _ratio(ops.rms_norm(x, w, 1e-6),
                                         rms_norm_reference(x, w, 1e-6), _rms64(x, w, 1e-6),
                                         dtype)
        residual = torch.randn(37, 103, generator=gen).to(dtype)
        summed = residual + x  # one rounding to the dtype, as the kernel's add
        got = ops.add_rms_norm_(x, residual, w, 1e-5)
        out[f"add_rms_norm_ residual {name}"] = float((residual.double() - summed.double())
                                                      .abs().max())
        out[f"add_rms_norm_ {name}"] = _ratio(got, rms_norm_reference(summed, w, 1e-5),
                                              _rms64(summed, w, 1e-5), dtype)
        gate_up = (3 * torch.randn(29, 2 * 75, generator=gen)).to(dtype)
        gate, up = gate_up.chunk(2, -1)
        exact = F.silu(gate.double()) * up.double()
        out[f"silu_and_mul {name}"] = _ratio(ops.silu_and_mul(gate_up), F.silu(gate) * up,
                                             exact, dtype)
        for head_dim in (64, 40):  # whole registers per half / the scalar loop
            rotary = RotaryEmbedding(head_dim, 10000.0, None, 512)
            qkv = torch.randn(11, 8, head_dim, generator=gen).to(dtype)
            positions = torch.randint(0, 500, (11,), generator=gen)
            rope = rotary.inputs(positions, dtype)
            cos, sin = rope.rows()
            x_rot = qkv[:, :6]
            ref = apply_rope_reference(x_rot, cos, sin)
            exact = apply_rope_reference(x_rot.double(), cos.double(), sin.double())
            untouched = qkv[:, 6:].clone()
            ops.rope_(x_rot, rope.positions, rope.cos_table, rope.sin_table)
            out[f"rope d{head_dim} {name}"] = _ratio(x_rot, ref, exact, dtype)
            out[f"rope d{head_dim} {name} untouched"] = bool(torch.equal(qkv[:, 6:], untouched))
    return out
