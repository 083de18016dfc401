"""A GGUF checkpoint's 4- and 5-bit tensors with offsets (Q4_0, Q4_1, Q4_K, Q5_1, Q5_K) built
as an `Int4Linear` (int4_linear.py) before the weights are read: a linear, or a fused one's
parts (q/k/v, gate/up) concatenated as the model fuses them, 4-bit parts beside 5-bit ones
taking zero fifth bits (the same values)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedkv.model.quant.gguf_parts import gguf_parts
from pagedkv.model.quant.int4_blocks import (
    GROUP,
    INT4_TYPES,
    TWO_LEVEL_TYPES,
    code_bits,
    codes_and_scales,
    k_quant_two_level,
    with_fifth_bits,
)
from pagedkv.model.quant.int4_linear import Int4Linear


def gguf_int4_linear(checkpoint: Any, sources: list[str], in_features: int,
                     bias: torch.Tensor | None = None) -> Int4Linear | None:
    """The linear on `in_features` whose weight is the GGUF blocks of `sources` (their rows
    concatenated) as an Int4Linear, or None where they are not all of INT4_TYPES or the shape
    does not fit the int4 kernel (rows a multiple of 16, columns of 32); where they are all
    K-quants (Q4_K, Q5_K), with the file's two levels of scales (`Int4Linear.from_two_level`). `bias`: the layer's bias
    parameter (or None), whose shape the new module's takes, zero until the weights are
    loaded."""
    rows = sum(checkpoint.shape(source)[0] for source in sources)
    if rows % 16 or in_features % GROUP:
        return None
    bias = None if bias is None else torch.zeros_like(bias)
    groups = in_features // GROUP
    if in_features % 256 == 0:  # every part a K-quant: its scales kept in two levels
        two_level = gguf_parts(checkpoint, sources, TWO_LEVEL_TYPES, k_quant_two_level)
        if two_level is not None:
            codes, table = zip(*two_level, strict=True)
            return Int4Linear.from_two_level(_same_bits(codes, groups), np.concatenate(table),
                                             bias)
    parts = gguf_parts(checkpoint, sources, INT4_TYPES, codes_and_scales)
    if parts is None:
        return None
    codes, scale, zero = zip(*parts, strict=True)
    return Int4Linear(_same_bits(codes, groups), np.concatenate(scale), np.concatenate(zero),
                      bias)


def _same_bits(codes: tuple[np.ndarray, ...], groups: int) -> np.ndarray:
    """The parts' packed codes concatenated, 4-bit parts with zero fifth bits where another
    part has 5-bit codes."""
    if len({code_bits(part, groups) for part in codes}) > 1:
        codes = tuple(with_fifth_bits(part) if code_bits(part, groups) == 4 else part
                      for part in codes)
    return np.concatenate(codes)
