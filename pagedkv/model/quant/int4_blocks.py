"""GGUF's 4- and 5-bit block formats with a scale and an offset read as one shape: a code per
weight and, per group of 32 weights along a row, a scale and an offset, with weight = code *
scale + offset.

Each of these GGUF types fits it exactly (llama.cpp's ggml-common.h block layouts):
- Q4_0: blocks of 32 = fp16 d, 16 bytes of codes; w = d * q - 8 * d (both float16 exactly);
- Q4_1: blocks of 32 = fp16 d, fp16 m, 16 bytes; w = d * q + m (the file's float16 values);
- Q5_1: as Q4_1 with a uint32 qh after m, bit j code j's fifth bit (codes 0..31);
- Q4_K: super-blocks of 256 = fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for eight
  sub-blocks of 32, 128 bytes; w = (d * sc) * q - dmin * mn (each product exact in float32);
- Q5_K: as Q4_K with 32 bytes of qh before the 128 (byte l's bit c: the fifth bit of code l of
  sub-block c).
In Q4_0 / Q4_1 byte j of a block holds code j (low nibble) and code j + 16 (high nibble); in
the K-quants byte j of a 64-weight chunk holds codes j and j + 32. `codes_and_scales` returns
the codes re-laid in the kernels' layout (`pack_group_codes`: the Q4_0 order's nibbles, uint8
[N, K / 2], then for the 5-bit types the fifth bits, [N, K / 8]).
(Q5_0 has no offset of its own beyond -16 d: it is the int8-block family's, int8_blocks.py.)
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

GROUP = 32
FIVE_BIT_TYPES = frozenset({GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q5_K})
INT4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                        GGMLQuantizationType.Q4_K}) | FIVE_BIT_TYPES
# The K-quants whose scales the kernels keep in the file's two levels.
TWO_LEVEL_TYPES = frozenset({GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K})
_SUPER_BLOCK_BYTES = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176}


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def pack_group_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes uint8 [N, K] (0 .. 2^bits - 1; bits 4 or 5) in the kernels' layout: per group of 32
    a row's nibbles in Q4_0 order (byte j: code j | code j + 16 << 4), [N, K/2], then for 5
    bits the fifth bits, 4 bytes a group (the little-endian uint32's bit j: code j's), [N, K/8]."""
    n = codes.shape[0]
    groups = codes.reshape(n, -1, 32)
    nibbles = ((groups[..., :16] & 15) | ((groups[..., 16:] & 15) << 4)).reshape(n, -1)
    if bits == 4:
        return np.ascontiguousarray(nibbles.astype(np.uint8))
    fifth = np.packbits((groups >> 4) & 1, axis=2, bitorder="little").reshape(n, -1)
    return np.ascontiguousarray(np.concatenate((nibbles, fifth), axis=1).astype(np.uint8))


def _q4_01(raw: np.ndarray, with_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, row_bytes = raw.shape
    block = 20 if with_min else 18
    blocks = raw.reshape(n, row_bytes // block, block)
    d = _fp16(blocks[..., 0:2])
    offset = _fp16(blocks[..., 2:4]) if with_min else -8 * d
    nibbles = blocks[..., block - 16:]
    return nibbles.reshape(n, -1), d, offset


def _q5_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, row_bytes = raw.shape
    blocks = raw.reshape(n, row_bytes // 24, 24)
    fifth = blocks[..., 4:8].reshape(n, -1)  # qh: the kernels' own layout
    codes = np.concatenate((blocks[..., 8:].reshape(n, -1), fifth), axis=1)
    return np.ascontiguousarray(codes), _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])


def _k_quant_codes(blocks: np.ndarray, n: int, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """The codes of Q4_K / Q5_K super-blocks [blocks, bytes] in the kernels' layout
    (`pack_group_codes`), [n, K/2] or [n, K/2 + K/8]."""
    qs = blocks[:, -128:].reshape(-1, 4, 32)  # 4 chunks of 64 codes: j | j + 32
    codes = np.stack((qs & 15, qs >> 4), axis=2).reshape(-1, 8, 32)  # [blocks, sub-block, 32]
    if ggml_type == GGMLQuantizationType.Q4_K:
        return pack_group_codes(codes.reshape(n, -1), 4)
    qh = blocks[:, 16:48]  # byte l, bit c: code l of sub-block c's fifth bit
    fifth = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return pack_group_codes((codes | (fifth << 4)).reshape(n, -1), 5)


def _k_quant_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit sub-scales and mins [blocks, 8] of Q4_K / Q5_K super-blocks (the same 12
    bytes in both)."""
    sc, mn = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return sc.reshape(-1, 8), mn.reshape(-1, 8)


def _k_quant(raw: np.ndarray, ggml_type: GGMLQuantizationType
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = raw.shape[0]
    blocks = raw.reshape(-1, _SUPER_BLOCK_BYTES[ggml_type])  # every super-block of every row
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    sc, mn = _k_quant_scales(blocks)
    scale = d[:, None] * sc.astype(np.float32)  # [blocks, 8]
    offset = -dmin[:, None] * mn.astype(np.float32)
    return _k_quant_codes(blocks, n, ggml_type), scale.reshape(n, -1), offset.reshape(n, -1)


def k_quant_two_level(raw: np.ndarray, ggml_type: GGMLQuantizationType
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(codes in the kernels' layout, table uint8 [N, 2.5 * K/32]) of Q4_K or Q5_K rows `raw`:
    per row the groups' 6-bit sub-scales, their 6-bit mins, then per super-block of 256 the
    fp16 d and the fp16 -dmin (their bytes), the layout kernels/csrc/quant_int4.cpp's
    TwoLevel reads: scale = d * sub-scale, offset = -dmin * min (`two_level_scales`)."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, _SUPER_BLOCK_BYTES[ggml_type])
    sc, mn = _k_quant_scales(blocks)
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16)
    neg_dmin = -np.ascontiguousarray(blocks[:, 2:4]).view(np.float16)
    table = np.concatenate((sc.astype(np.uint8).reshape(n, -1),
                            mn.astype(np.uint8).reshape(n, -1), d.reshape(n, -1).view(np.uint8),
                            neg_dmin.reshape(n, -1).view(np.uint8)), axis=1)
    return _k_quant_codes(blocks, n, ggml_type), np.ascontiguousarray(table)



def two_level_scales(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, offset) float32 [N, G] of a `k_quant_two_level` table [N, 2.5 * G]."""
    groups = table.shape[1] * 2 // 5
    sub = table[:, :groups].astype(np.float32)
    mins = table[:, groups:2 * groups].astype(np.float32)
    halves = np.ascontiguousarray(table[:, 2 * groups:]).view(np.float16).astype(np.float32)
    d, neg_dmin = halves[:, :groups // 8], halves[:, groups // 8:]
    return np.repeat(d, 8, axis=1) * sub, np.repeat(neg_dmin, 8, axis=1) * mins


def codes_and_scales(raw: np.ndarray, ggml_type: GGMLQuantizationType
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 in the kernels' layout, [N, K/2] or for 5 bits [N, K/2 + K/8]
    (`pack_group_codes`), scale float32 [N, K/32], offset float32 [N, K/32]) of a GGUF tensor's
    rows `raw` (uint8 [N, bytes per row]) of a type of INT4_TYPES. ValueError for another
    type."""
    if ggml_type == GGMLQuantizationType.Q4_0:
        return _q4_01(raw, with_min=False)
    if ggml_type == GGMLQuantizationType.Q4_1:
        return _q4_01(raw, with_min=True)
    if ggml_type == GGMLQuantizationType.Q5_1:
        return _q5_1(raw)
    if ggml_type in TWO_LEVEL_TYPES:
        return _k_quant(raw, ggml_type)
    raise ValueError(f"ggml type {ggml_type.name} is not a 4- or 5-bit group-32 type with "
                     f"offsets; these are: {', '.join(sorted(t.name for t in INT4_TYPES))}")


def code_bits(packed: np.ndarray | int, groups: int) -> int:
    """4 or 5: the bits of codes packed as `pack_group_codes` does, `packed` [N, width] (an
    array or tensor, or the width), `groups` groups of 32 a row. ValueError for a width neither
    gives."""
    width = packed if isinstance(packed, int) else int(packed.shape[1])
    if width == 16 * groups:
        return 4
    if width == 20 * groups:
        return 5
    raise ValueError(f"packed codes of {width} bytes a row fit neither 4-bit ({16 * groups}) "
                     f"nor 5-bit ({20 * groups}) codes of {groups} groups of 32")


def with_fifth_bits(packed: np.ndarray) -> np.ndarray:
    """4-bit packed codes [N, K/2] as 5-bit ones (their fifth bits zero), the same values."""
    return np.concatenate((packed, np.zeros((packed.shape[0], packed.shape[1] // 4), np.uint8)),
                          axis=1)


def codes(packed: np.ndarray, groups: int | None = None) -> np.ndarray:
    """The codes [N, K] (uint8, 0..15 or 0..31) of `packed` (`pack_group_codes`' layout;
    `groups` a row, or None for 4-bit codes)."""
    n = packed.shape[0]
    groups = packed.shape[1] // 16 if groups is None else groups
    nibbles = packed[:, :16 * groups].reshape(n, -1, 16)
    out = np.concatenate((nibbles & 15, nibbles >> 4), axis=2)
    if code_bits(packed, groups) == 5:
        fifth = np.unpackbits(packed[:, 16 * groups:].reshape(n, -1, 4), axis=2,
                              bitorder="little")
        out = out | (fifth << 4)
    return out.reshape(n, -1)
