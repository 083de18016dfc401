"""GGUF's 4-bit block formats read as one shape: a 4-bit code per weight and, per group of 32
weights along a row, a scale and an offset, with weight = code * scale + offset.

Every 4-bit GGUF type fits it exactly (llama.cpp's ggml-common.h block layouts):
- Q4_0: blocks of 32 = fp16 d, 16 bytes of codes; w = d * q - 8 * d (both float16 exactly);
- Q4_1: blocks of 32 = fp16 d, fp16 m, 16 bytes; w = d * q + m (the file's float16 values);
- Q4_K: super-blocks of 256 = fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for eight
  sub-blocks of 32, 128 bytes; w = (d * sc) * q - dmin * mn (each product exact in float32).
In Q4_0 / Q4_1 byte j of a block holds code j (low nibble) and code j + 16 (high nibble); in
Q4_K byte j of a 64-weight chunk holds codes j and j + 32. `codes_and_scales` returns the codes
re-laid as `nibbles` in the Q4_0 order for every type (uint8 [N, K / 2]).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

GROUP = 32
INT4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                        GGMLQuantizationType.Q4_K})


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _q4_01(raw: np.ndarray, with_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, row_bytes = raw.shape
    block = 20 if with_min else 18
    blocks = raw.reshape(n, row_bytes // block, block)
    d = _fp16(blocks[..., 0:2])
    offset = _fp16(blocks[..., 2:4]) if with_min else -8 * d
    nibbles = blocks[..., block - 16:]
    return nibbles.reshape(n, -1), d, offset


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, row_bytes = raw.shape
    blocks = raw.reshape(-1, 144)  # every super-block of every row
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    sc, mn = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    scale = d[:, None] * sc.astype(np.float32)  # [blocks, 8]
    offset = -dmin[:, None] * mn.astype(np.float32)
    return _q4_k_nibbles(blocks, n), scale.reshape(n, -1), offset.reshape(n, -1)


def _q4_k_nibbles(blocks: np.ndarray, n: int) -> np.ndarray:
    """The codes of Q4_K super-blocks [blocks, 144] as nibbles [n, K/2] in Q4_0 order."""
    qs = blocks[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 codes: j | j + 32
    codes = np.stack((qs & 15, qs >> 4), axis=2).reshape(-1, 8, 32)  # [blocks, sub-block, 32]
    return (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, -1)


def q4_k_two_level(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nibbles uint8 [N, K/2] in Q4_0 order, table uint8 [N, 2.5 * K/32]) of Q4_K rows `raw`:
    per row the groups' 6-bit sub-scales, their 6-bit mins, then per super-block of 256 the
    fp16 d and the fp16 -dmin (their bytes), the layout kernels/csrc/quant_int4.cpp's
    TwoLevel reads: scale = d * sub-scale, offset = -dmin * min (`two_level_scales`)."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    sc, mn = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16)
    neg_dmin = -np.ascontiguousarray(blocks[:, 2:4]).view(np.float16)
    table = np.concatenate((sc.astype(np.uint8).reshape(n, -1),
                            mn.astype(np.uint8).reshape(n, -1), d.reshape(n, -1).view(np.uint8),
                            neg_dmin.reshape(n, -1).view(np.uint8)), axis=1)
    return _q4_k_nibbles(blocks, n), np.ascontiguousarray(table)


def two_level_scales(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) float32 [N, G] of a `q4_k_two_level` table [N, 2.5 * G]."""
    groups = table.shape[1] * 2 // 5
    sub = table[:, :groups].astype(np.float32)
    mins = table[:, groups:2 * groups].astype(np.float32)
    halves = np.ascontiguousarray(table[:, 2 * groups:]).view(np.float16).astype(np.float32)
    d, neg_dmin = halves[:, :groups // 8], halves[:, groups // 8:]
    return np.repeat(d, 8, axis=1) * sub, np.repeat(neg_dmin, 8, axis=1) * mins


def codes_and_scales(raw: np.ndarray, ggml_type: GGMLQuantizationType
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nibbles uint8 [N, K/2] in Q4_0 order, scale float32 [N, K/32], offset float32 [N, K/32])
    of a 4-bit GGUF tensor's rows `raw` (uint8 [N, bytes per row]). ValueError for another
    type."""
    if ggml_type == GGMLQuantizationType.Q4_0:
        return _q4_01(raw, with_min=False)
    if ggml_type == GGMLQuantizationType.Q4_1:
        return _q4_01(raw, with_min=True)
    if ggml_type == GGMLQuantizationType.Q4_K:
        return _q4_k(raw)
    raise ValueError(f"ggml type {ggml_type.name} is not a 4-bit group-32 type; "
                     f"these are: {', '.join(sorted(t.name for t in INT4_TYPES))}")


def codes(nibbles: np.ndarray) -> np.ndarray:
    """The 4-bit codes [N, K] (uint8, 0..15) of `nibbles` [N, K/2] in Q4_0 order."""
    n = nibbles.shape[0]
    blocks = nibbles.reshape(n, -1, 16)
    return np.concatenate((blocks & 15, blocks >> 4), axis=2).reshape(n, -1)
