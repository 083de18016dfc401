"""A GGUF checkpoint's 4-bit tensors (Q4_0, Q4_1, Q4_K) built as an `Int4Linear`
(int4_linear.py) before the weights are read: a linear, or a fused one's parts (q/k/v, gate/up)
concatenated as the model fuses them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedkv.model.quant.gguf_parts import gguf_parts
from pagedkv.model.quant.int4_blocks import GROUP, INT4_TYPES, codes_and_scales, q4_k_two_level
from pagedkv.model.quant.int4_linear import Int4Linear


def gguf_int4_linear(checkpoint: Any, sources: list[str], in_features: int,
                     bias: torch.Tensor | None = None) -> Int4Linear | None:
    """The linear on `in_features` whose weight is the GGUF blocks of `sources` (their rows
    concatenated) as an Int4Linear, or None where they are not all 4-bit or the shape does not
    fit the int4 kernel (rows a multiple of 16, columns of 32); where they are all Q4_K, with
    the file's two levels of scales (`Int4Linear.from_two_level`). `bias`: the layer's bias
    parameter (or None), whose shape the new module's takes, zero until the weights are
    loaded."""
    rows = sum(checkpoint.shape(source)[0] for source in sources)
    if rows % 16 or in_features % GROUP:
        return None
    bias = None if bias is None else torch.zeros_like(bias)
    if in_features % 256 == 0:  # every part Q4_K: its scales kept in two levels
        two_level = gguf_parts(checkpoint, sources, (GGMLQuantizationType.Q4_K,),
                               lambda rows, _: q4_k_two_level(rows))
        if two_level is not None:
            nibbles, table = (np.concatenate(arrays) for arrays in zip(*two_level, strict=True))
            return Int4Linear.from_two_level(nibbles, table, bias)
    parts = gguf_parts(checkpoint, sources, INT4_TYPES, codes_and_scales)
    if parts is None:
        return None
    nibbles, scale, zero = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
    return Int4Linear(nibbles, scale, zero, bias)
