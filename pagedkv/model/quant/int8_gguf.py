"""A GGUF checkpoint's Q8_0 / Q6_K / Q5_0 / Q3_K / IQ4 tensors built as packed modules
(int8_block_linear.py) before the weights are read: linears (q/k/v and gate/up concatenated,
as the model fuses them; vocab.py builds the LM head and the embedding table from them).

Where every part is Q6_K, the codes stay 6 bits and the scales in the file's two levels
(int8_blocks.q6_k_two_level, packed_codes: the file's 0.82 bytes a weight), where every part
is Q3_K 3 bits with its two levels (q3_k_two_level: 0.45, the file's 0.43); where every part is
Q5_0 (and K a multiple of 64), the codes stay 5 bits with the file's float16 scales (0.69),
where every part is IQ4_NL or IQ4_XS, 4-bit indices into their table (0.56-0.63);
a fused linear whose parts mix Q6_K with Q8_0 or Q5_0 takes float32 scales in blocks of 16
(each 32-block scale twice: exact); one with 4-bit parts too is built as a linear per run
(parts_linear.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from pagedkv.model.quant.gguf_parts import gguf_parts, gguf_types, narrowest_scales
from pagedkv.model.quant.int8_block_linear import Int8BlockLinear
from pagedkv.model.quant.int8_blocks import (
    INT8_BLOCK_TYPES,
    int8_codes_and_scales,
    packed_codes,
    q3_k_two_level,
    q6_k_two_level,
)


def _codes_and_scales(checkpoint: Any, sources: list[str]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes [N, K], scales [N, K / block]) of the rows of `sources` concatenated, or None
    where one is not an int8-block type. The codes are int8, or kept in the file's bits where
    every part's are below 8 (`_packed_bits`, packed_codes: uint8). The scales are float16
    where every one is exactly a float16 (Q8_0's own values: half the bytes a decode step reads
    for them), else float32 (a mix of Q6_K's products of two scales and others), or where
    every part is Q6_K the file's two levels (uint8)."""
    for kind, (read, bits) in _TWO_LEVEL.items():  # the codes in the file's bits, two levels
        two_level = gguf_parts(checkpoint, sources, (kind,), lambda rows, _, read=read: read(rows))
        if two_level is not None:
            codes, table = (np.concatenate(arrays) for arrays in zip(*two_level, strict=True))
            return torch.from_numpy(packed_codes(codes, bits)), torch.from_numpy(table)
    parts = gguf_parts(checkpoint, sources, INT8_BLOCK_TYPES, int8_codes_and_scales)
    if parts is None:
        return None
    block = min(part[2] for part in parts)
    codes = np.concatenate([part[0] for part in parts])
    scales = np.concatenate([np.repeat(part[1], part[2] // block, axis=1) for part in parts])
    bits = _packed_bits(gguf_types(checkpoint, sources))
    if bits and codes.shape[1] % 64 == 0:  # Q5_0's codes in 5 bits, IQ4's in 4
        codes = packed_codes(codes, bits)
    return torch.from_numpy(codes), torch.from_numpy(
        np.ascontiguousarray(narrowest_scales(scales)))


# The types whose scales stay in the file's two levels: their reader and their codes' bits.
_TWO_LEVEL = {GGMLQuantizationType.Q6_K: (q6_k_two_level, 6),
              GGMLQuantizationType.Q3_K: (q3_k_two_level, 3)}


def _packed_bits(types: list[int]) -> int:
    """The bits packed_codes keeps these parts' codes in (blocks of 32): 5 where all are Q5_0, 4
    where all are IQ4_NL or IQ4_XS (one table), else 0 (int8 codes)."""
    kinds = set(types)
    if kinds == {GGMLQuantizationType.Q5_0}:
        return 5
    if kinds <= {GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS}:
        return 4
    return 0


def gguf_int8_block_linear(checkpoint: Any, sources: list[str], in_features: int,
                           bias: torch.Tensor | None = None) -> Int8BlockLinear | None:
    """The linear on `in_features` whose weight is the GGUF blocks of `sources` (their rows
    concatenated) as an Int8BlockLinear, or None where they are not all int8-block types
    (`int8_blocks.INT8_BLOCK_TYPES`) or K is not a multiple of 32. `bias`: the layer's bias
    parameter (or None), whose shape the new module's takes, zero until the weights are
    loaded."""
    if in_features % 32:
        return None
    packed = _codes_and_scales(checkpoint, sources)
    if packed is None:
        return None
    return Int8BlockLinear(*packed, None if bias is None else torch.zeros_like(bias))

