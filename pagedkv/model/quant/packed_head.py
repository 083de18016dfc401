"""The LM head with an int8 copy for decode-sized calls: logits = h W^T with W the head's (or,
tied, the embeddings') dense weight [vocab, hidden].

At batch 1 the head is the largest single matmul of a small model (SmolLM2-135M: 49152 x 576,
about a fifth of a packed decode step), and memory-bound: per-row int8 codes read half the
bytes. Calls of up to `HEAD_INT8_ROWS` rows (decode steps: one row per sequence) run the fused
CPU kernels' `int8_gemv` (kernels/csrc/quant_int4.cpp: activations quantized to int8 per group
of 32, VNNI or AVX2 integer dot products; about 1.5x torch's `_weight_int8pack_mm`, which runs
before the kernels load); larger ones (prompt logprobs, many sequences) the dense weight, which
the embedding lookup keeps anyway. The int8 codes round each weight by at most half a step of
its row's scale (max |w| / 127).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.kernels.cpu import cpu_kernels_loaded
from pagedkv.model.quant.int8_linear import int8_per_row

HEAD_INT8_ROWS = 4


class Int8PackedHead(nn.Module):
    """Logits from a dense head weight, through its per-row int8 copy at <= HEAD_INT8_ROWS rows.
    All three are parameters, the dense one the very parameter given (tied: the embeddings',
    which the model's parameters then list once), so the model's bytes count each once."""

    def __init__(self, dense_weight: nn.Parameter) -> None:
        super().__init__()
        self.dense = dense_weight
        self.out_features, self.in_features = self.dense.shape
        codes, scale = int8_per_row(dense_weight)
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features)
        if rows.shape[0] <= HEAD_INT8_ROWS and cpu_kernels_loaded() \
                and self.in_features % 32 == 0:
            y = torch.ops.pagedkv_cpu.int8_gemv(rows.contiguous(), self.codes, self.scale, None)
        elif rows.shape[0] <= HEAD_INT8_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(),
                                                   self.codes, self.scale).to(hidden.dtype)
        else:
            y = F.linear(rows, self.dense.to(hidden.dtype))
        return y.view(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 up to {HEAD_INT8_ROWS} rows")


def pack_head(model: nn.Module) -> bool:
    """Give `model` an Int8PackedHead over its lm_head's weight or, tied, its embeddings'
    (mutates `model`: its `lm_head` attribute, which compute_logits uses when set). False where
    the model has neither as a plain 2-D weight (e.g. a vocabulary-parallel shard)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None) if head is not None else \
        getattr(getattr(model, "embed_tokens", None), "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 \
            or getattr(head, "bias", None) is not None:
        return False
    model.lm_head = Int8PackedHead(weight)
    return True
