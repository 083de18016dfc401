"""The CUDA path's fused RMSNorm and SiLU-and-mul against the torch code they replace (on CPU
under Triton's interpreter, on CUDA compiled)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from pagedkv.model.fused_ops import rms_norm, silu_and_mul  # noqa: E402
from pagedkv.model.layers import RMSNorm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter has no bfloat16 arithmetic (numpy): float16 there.
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rms_norm_matches_torch_path(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    x = (3 * torch.randn(7, 96, generator=gen)).to(dtype)
    want = norm.forward(x)  # CPU tensors: the torch path
    got = rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), 1e-6).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # equal up to one rounding step of the half dtype (reduction order)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_silu_and_mul_matches_torch_path(dtype):
    gen = torch.Generator().manual_seed(1)
    gate_up = (2 * torch.randn(5, 2 * 1500, generator=gen)).to(dtype)
    gate, up = gate_up.split(1500, dim=-1)
    want = F.silu(gate).mul_(up)
    got = silu_and_mul(gate_up.to(DEVICE)).cpu()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2 if dtype != torch.float32
                               else 1e-6, atol=1e-6)
