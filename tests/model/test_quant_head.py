"""The LM head's int8 copy (pagedkv/model/quant/packed_head.py): decode-sized calls, on the fused
kernel (int16 activations) and on torch's (before the kernels load), against a float64 product
of the int8 weight (within the bfloat16 rounding of activations and output and the int16 step)
and of the dense weight (within half an int8 step per weight); larger calls exactly the dense
matmul; `pack_head` on a tied and an untied head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.quant import packed_head
from pagedkv.model.quant.packed_head import HEAD_INT8_ROWS, Int8PackedHead, pack_head

VOCAB, HIDDEN = 320, 128
BF16_REL = 2.0 ** -8  # one bfloat16 rounding (2^-9) of the activations and one of the output


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, HIDDEN, generator=g) * torch.rand(VOCAB, 1, generator=g)
    return w.bfloat16()


@pytest.mark.parametrize("rows", [1, 2, HEAD_INT8_ROWS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_int8_rows_equal_float64_reference(weight, rows, dtype, kernel, monkeypatch):
    if kernel == "fused":
        assert ensure_cpu_kernels("wait")
    else:
        monkeypatch.setattr(packed_head, "cpu_kernels_loaded", lambda: False)
    head = Int8PackedHead(weight)
    h = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
    h[:, 3] *= 40  # an outlier feature, as real hidden states have
    y = head(h)
    assert y.dtype == dtype and y.shape == (rows, VOCAB)
    h64 = h.bfloat16().double()  # activations rounded to bfloat16 (torch's) or int16 (fused)
    wq = head.codes.double() * head.scale.double()[:, None]
    magnitude = h64.abs() @ wq.abs().T
    # The fused kernel's int16 step: max |h| / 32767 a row, half of it at most per value.
    int16 = h.double().abs().amax(dim=1, keepdim=True) / 65534 * wq.abs().sum(dim=1)
    err = (y.double() - h.double() @ wq.T).abs()
    assert (err <= BF16_REL * magnitude + int16 + 1e-6).all(), err.max()
    # Against the dense weight: code * scale is within half a step of the weight, and the
    # scale's bfloat16 rounding moves it by at most 127 * 2^-9 steps more.
    half_step = head.scale.double()[:, None] * (1 + BF16_REL) * (0.5 + 127 * 2.0 ** -9)
    err_bound = h64.abs() @ half_step.expand(-1, HIDDEN).T + 2 * BF16_REL * magnitude
    exact = h64 @ weight.double().T
    assert ((y.double() - exact).abs() <= err_bound + 1e-6).all()


def test_codes_round_to_nearest(weight):
    head = Int8PackedHead(weight)
    step = weight.float().abs().amax(dim=1, keepdim=True) / 127
    assert (head.codes.float() * step - weight.float()).abs().le(step / 2 + 1e-7).all()
    assert head.codes.abs().amax(dim=1).eq(127).all()


@pytest.mark.parametrize("rows", [HEAD_INT8_ROWS + 1, 64])
def test_larger_calls_use_the_dense_weight(weight, rows):
    head = Int8PackedHead(weight)
    h = torch.randn(rows, HIDDEN).bfloat16()
    torch.testing.assert_close(head(h), h @ weight.T, rtol=0, atol=0)


class _Model(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = None if tied else nn.Linear(HIDDEN, VOCAB, bias=False)


@pytest.mark.parametrize("tied", [True, False])
def test_pack_head_wraps_the_heads_weight(tied):
    model = _Model(tied)
    dense = model.embed_tokens.weight if tied else model.lm_head.weight
    assert pack_head(model)
    assert isinstance(model.lm_head, Int8PackedHead)
    assert model.lm_head.dense is dense  # no second dense copy, its bytes counted once
    counted = sum(p.numel() * p.element_size() for p in model.parameters())
    assert counted == (1 if tied else 2) * VOCAB * HIDDEN * 4 + VOCAB * (HIDDEN + 2)


def test_pack_head_leaves_a_biased_head():
    model = _Model(tied=False)
    model.lm_head = nn.Linear(HIDDEN, VOCAB, bias=True)
    assert not pack_head(model)
    assert isinstance(model.lm_head, nn.Linear)
