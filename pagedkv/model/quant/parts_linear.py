"""A fused linear (q/k/v as `qkv_proj`, gate/up as `gate_up_proj`) whose GGUF parts are each
packable but not together: llama.cpp's Q4_K_M files store half the layers' attn_q and attn_k in
Q4_K and their attn_v in Q6_K. Each run of consecutive parts of one family becomes one packed
linear (4-bit: `Int4Linear`; int8 blocks: `Int8BlockLinear`), y = their outputs concatenated
along the last dim, plus the fused bias (loaded into this module's `bias`) added once, so half
those layers' qkv no longer read a dense 2-byte weight.

The decode stack (model/decode_stack.py) runs it as its parts' ops and the same concatenation
and bias (`LinearParts`). The parts are submodules: the model's parameter bytes count them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedkv.model.decode_stack import LinearParts
from pagedkv.model.quant.gguf_parts import gguf_types
from pagedkv.model.quant.int4_blocks import INT4_TYPES
from pagedkv.model.quant.int4_gguf import gguf_int4_linear
from pagedkv.model.quant.int8_blocks import INT8_BLOCK_TYPES
from pagedkv.model.quant.int8_gguf import gguf_int8_block_linear

# Each packed family: the ggml types it takes, and its builder from a list of GGUF sources.
_FAMILIES = ((INT4_TYPES, gguf_int4_linear), (INT8_BLOCK_TYPES, gguf_int8_block_linear))


class PartsLinear(nn.Module):
    """y = concat(part(x) for part in parts, last dim) (+ bias), each part a packed linear on
    the same input with its own rows of the output."""

    def __init__(self, parts: list[nn.Module], bias: torch.Tensor | None = None) -> None:
        """`parts`: linears taking the same `in_features` (ValueError otherwise, or for fewer
        than two); `bias` [sum of their out_features] (its values copied)."""
        super().__init__()
        ks = {part.in_features for part in parts}
        if len(parts) < 2 or len(ks) != 1:
            raise ValueError(f"PartsLinear: needs two or more parts on the same in_features, "
                             f"got {len(parts)} on {sorted(ks)}")
        self.parts = nn.ModuleList(parts)
        self.in_features = ks.pop()
        self.out_features = sum(part.out_features for part in parts)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"PartsLinear: bias of shape {list(bias.shape)} for "
                             f"{self.out_features} outputs")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out_features, in_features] in `dtype`: the parts' weights stacked."""
        return torch.cat([part.dequantized(dtype) for part in self.parts])

    def decode_call(self, rows: int) -> LinearParts | None:
        """The ops `forward` runs with the fused kernels loaded, one per part, and the bias
        added after them (decode_stack.py); None where a part gives none."""
        calls = tuple(part.decode_call(rows) for part in self.parts)
        if any(call is None for call in calls):
            return None
        return LinearParts(calls, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def gguf_parts_linear(checkpoint: Any, sources: list[str], in_features: int,
                      bias: torch.Tensor | None = None) -> PartsLinear | None:
    """The fused linear on `in_features` whose weight is the GGUF tensors `sources` (rows
    concatenated) as a PartsLinear: one packed linear per run of consecutive sources of one
    family (`_FAMILIES`), or None where they are all one family (the family's own builder
    takes them), one is of neither, or a run's shape does not fit its kernel. `bias`: the
    layer's bias parameter (or None), whose shape the new module's takes, zero until the
    weights are loaded."""
    runs: list[tuple[Any, list[str]]] = []
    for source, ggml_type in zip(sources, gguf_types(checkpoint, sources), strict=True):
        build = next((b for types, b in _FAMILIES if ggml_type in types), None)
        if build is None:
            return None
        if runs and runs[-1][0] is build:
            runs[-1][1].append(source)
        else:
            runs.append((build, [source]))
    if len(runs) < 2:
        return None
    parts = []
    for build, run in runs:
        part = build(checkpoint, run, in_features)
        if part is None:
            return None
        parts.append(part)
    return PartsLinear(parts, None if bias is None else torch.zeros_like(bias))
