"""Fused Triton kernels for the elementwise steps of a layer on CUDA: RMSNorm and SiLU-and-mul.

In torch each is several kernels over the activations (RMSNorm: upcast, square, mean, rsqrt,
scale, downcast, weight); at prefill sizes they cost as much GPU time as the matrix products,
and at decode each launch costs more than its work. Each kernel here reads its input once and
writes its output once, rounding as the torch code in layers.py does (statistics in float32,
the result cast to the activation dtype before the weight multiply; SiLU rounded to the
activation dtype before the multiply), so results match it to float32 reduction order.
layers.py calls these for CUDA tensors only; they also run under Triton's interpreter on CPU
tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    h = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalised x for x [T, N] with a contiguous last dim (a new tensor)."""
    t, n = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if t:
        _rms_norm_kernel[(t,)](x, weight, out, x.stride(0), out.stride(0), n, eps,
                               BLOCK=triton.next_power_of_2(n))
    return out


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * I] = [gate | up] (a new [T, I] tensor)."""
    t, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0),
                                                         out.stride(0), n, BLOCK=block)
    return out
