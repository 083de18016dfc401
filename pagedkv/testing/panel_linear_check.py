"""panel_linear (pagedkv/kernels/csrc/panel_linear.cpp) against float64 F.linear of the same
inputs, with a rounding-error bound instead of a fixed tolerance; run by the tests in this
process's build and in the AVX2 build (PAGEDKV_CPU_ISA=avx2, a child process: one kernel library
per process).

The bound, elementwise, for y = x W^T + b with K terms: the kernels take x and W in the weights'
dtype as they are (16-bit values are exact in float32; vdpbf16ps multiplies bfloat16 pairs
exactly), so the only errors are float32 additions, at most K + 1 of them in any order, and
one rounding of y to the output dtype:
    acc   = (K + 1) * 2^-24 * (|x| |W|^T + |b|)       (float32 accumulation, first order)
    bound = acc + u * (|y| + acc)                       (u = 2^-8 bfloat16, 2^-11 float16, 0 float32)
oneDNN's bfloat16 kernel (bfloat16 inputs, float32 accumulation) meets the same bound.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# [N, K]: 3 panels (one group short of 4), 7 panels (a group and a short one) with an odd K
# (the paired layout's padding step), and a long K (the benchmark model's down projection's).
SHAPES = [(37, 72), (100, 71), (70, 1408)]
ROWS = [1, 5, 6, 7, 8, 13, 64, 200]  # tile remainders, 8 = 4 + 4, > 96 rows: two row chunks


def error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 F.linear of the inputs, the elementwise bound above)."""
    xd, wd = x.detach().double(), w.detach().double()
    bd = None if b is None else b.detach().double()
    want = F.linear(xd, wd, bd)
    scale = xd.abs() @ wd.abs().T + (0.0 if bd is None else bd.abs())
    acc = (x.shape[1] + 1) * 2.0 ** -24 * scale
    return want, acc + UNIT_ROUNDOFF[out_dtype] * (want.abs() + acc)


def worst_ratio(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None) -> float:
    """max |got - F.linear in float64| / bound (<= 1: within the bound)."""
    want, bound = error_bound(x, w, b, got.dtype)
    return float(((got.detach().double() - want).abs() / bound).max())


def check_panel_linear(seed: int = 0) -> dict:
    """{"isa": the build's panel path, "<dtype>": the worst error / bound over SHAPES x ROWS,
    bias and none, "packed_exactly": whether every packed weight unpacks to W, padding zero}.
    Needs the fused kernels (builds them)."""
    from pagedkv.kernels.cpu import ensure_cpu_kernels, panel_isa

    ensure_cpu_kernels("wait")
    ops = torch.ops.pagedkv_cpu
    gen = torch.Generator().manual_seed(seed)
    out: dict = {"isa": panel_isa(), "packed_exactly": True}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        worst = 0.0
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=gen).to(dtype)
            b = torch.randn(n, generator=gen).to(dtype)
            panels = ops.pack_panels(w)
            flat = unpack_panels(panels)
            out["packed_exactly"] &= bool(torch.equal(flat[:n, :k], w) and (flat[n:] == 0).all()
                                          and (flat[:, k:] == 0).all())
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen).to(dtype)
                for bias in (b, None):
                    got = ops.panel_linear(x, panels, n, bias)
                    assert got.dtype == dtype and got.shape == (rows, n)
                    worst = max(worst, worst_ratio(got, x, w, bias))
        out[str(dtype).removeprefix("torch.")] = worst
    return out


def unpack_panels(panels: torch.Tensor) -> torch.Tensor:
    """The packed panels back as [columns padded to 16, K (padded to even on the paired layout)]."""
    if panels.dim() == 4:  # [np, K/2, 16, 2]: pairs of K per column
        return panels.permute(0, 2, 1, 3).reshape(panels.shape[0] * 16, -1)
    return panels.permute(0, 2, 1).reshape(panels.shape[0] * 16, -1)  # [np, K, 16]
