"""GGUF's symmetric block formats read as one shape: an int8 code per weight and a float32 scale
per block of 16 or 32 along a row, weight = code * scale (exactly the file's values).

llama.cpp's ggml-common.h block layouts:
- Q8_0: blocks of 32 = fp16 d, 32 int8 codes; w = d * q (block 32, scale d);
- Q6_K: super-blocks of 256 = 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
  sub-scales, fp16 d; w = d * sc[i // 16] * (q - 32) with q 6 bits (block 16, scale d * sc:
  an fp16 times an int8 is exact in float32, and q - 32 is within [-32, 31]; or the two
  levels as the file has them: `q6_k_two_level`);
- Q5_0: blocks of 32 = fp16 d, 32 high bits, 16 bytes of low nibbles; w = d * (q - 16) with q
  5 bits (block 32, codes -16..15; llama.cpp falls back to Q5_0 in Q4_K mixes for rows that
  are not a multiple of 256, as SmolLM2's 576);
- Q3_K: super-blocks of 256 = 32 bytes of high bits, 64 of low 2-bit pairs, 12 bytes of
  6-bit sub-scales, fp16 d; w = d * (sc - 32) * q with q in -4..3 (block 16);
- IQ4_NL: blocks of 32 = fp16 d, 16 bytes of 4-bit indices into a table of 16 int8 values;
  w = d * table[q] (block 32, codes the table's values, -127..113);
- IQ4_XS: super-blocks of 256 = fp16 d, 6-bit sub-scales (2 + 4 bytes), 128 bytes of 4-bit
  indices into the same table; w = d * (sc - 32) * table[q] (block 32).
A code takes a byte here; Q6_K's, Q5_0's, IQ4's and Q3_K's are then kept in the file's 6, 5, 4
and 3 bits (`packed_codes`: 0.82, 0.69, 0.56-0.63 and 0.45 bytes a weight with their scales,
Q6_K's and Q3_K's in two levels: `q6_k_two_level`, `q3_k_two_level`), Q8_0's in a byte.
Each block's scale is read by dequantizing (the `gguf` package's own code) a copy of the block
whose codes are all set to 1; the codes are then the dequantized weights over their block's
scale, rounded: exact, as each weight is the scale times a code of at most 127 rounded once in
float32 (the scale an fp16 times a small integer).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

_T = GGMLQuantizationType
# ggml type -> block size of its scales.
INT8_BLOCK_TYPES = {_T.Q8_0: 32, _T.Q6_K: 16, _T.Q5_0: 32, _T.Q3_K: 16, _T.IQ4_NL: 32,
                    _T.IQ4_XS: 32}
# ggml type -> (first byte, end, byte value) of each stretch of a block's code bytes, the value
# making every code there 1 (Q6_K: low nibble 1, high pair 2 -> 33 - 32; Q5_0: low nibble 1,
# high bit 1 -> 17 - 16; Q3_K: low pair 1, high bit set (no -4); IQ4: index 8 -> table value 1).
_UNIT_CODES = {
    _T.Q6_K: ((0, 128, 0x11), (128, 192, 0xAA)),
    _T.Q5_0: ((2, 6, 0xFF), (6, 22, 0x11)),
    _T.Q3_K: ((0, 32, 0xFF), (32, 96, 0x55)),
    _T.IQ4_NL: ((2, 18, 0x88),),
    _T.IQ4_XS: ((8, 136, 0x88),),
}


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return codes.reshape(n, -1), _fp16(blocks[..., 0:2])


def _unit_scaled(raw: np.ndarray, ggml_type: GGMLQuantizationType
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [N, K], scales float32 [N, K / block]) of rows `raw` of a type in
    _UNIT_CODES: the scales from a copy of the blocks with every code 1, the codes from the
    weights over them (1 where the scale is 0: a code of every format, IQ4's table included)."""
    n, block = raw.shape[0], INT8_BLOCK_TYPES[ggml_type]
    unit = np.array(raw).reshape(-1, GGML_QUANT_SIZES[ggml_type][1])
    for start, stop, value in _UNIT_CODES[ggml_type]:
        unit[:, start:stop] = value
    scale = quants.dequantize(unit.reshape(n, -1), ggml_type).reshape(n, -1, block)[..., 0]
    w = quants.dequantize(np.ascontiguousarray(raw), ggml_type).reshape(n, -1, block)
    safe = np.where(scale == 0, 1, scale)[..., None]
    codes = np.where(scale[..., None] == 0, 1, np.rint(w / safe)).astype(np.int8)
    return codes.reshape(n, -1), scale.astype(np.float32)


def q6_k_two_level(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [N, K], table uint8 [N, K/16 + K/128]) of Q6_K rows `raw`: per row the
    blocks' int8 sub-scales, then per super-block of 256 its float16 d (their bytes), the
    layout kernels/csrc/quant_int8.cpp's TwoLevelScales reads: scale = d * sub-scale
    (`two_level_block_scales`), the float32 scales' very values in 0.07 bytes a weight, where
    they take 0.25. With the codes in 6 bits (`packed_codes`), 0.82 bytes a weight: the
    file's."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, GGML_QUANT_SIZES[_T.Q6_K][1])
    table = np.concatenate((blocks[..., 192:208].reshape(n, -1), blocks[..., 208:210]
                            .reshape(n, -1)), axis=1)
    return _unit_scaled(raw, _T.Q6_K)[0], np.ascontiguousarray(table)


def q3_k_two_level(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [N, K] within -4..3, table uint8 [N, K/16 + K/128]) of Q3_K rows `raw`, the
    layout of `q6_k_two_level`: per row the blocks' int8 sub-scales (the file's 6-bit ones
    minus 32, each block's scale over its super-block's d: exact), then each super-block's
    float16 d. With the codes in 3 bits (`packed_codes`), 0.45 bytes a weight (the file's
    0.43)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, GGML_QUANT_SIZES[_T.Q3_K][1])
    d16 = np.ascontiguousarray(blocks[..., 108:110]).view(np.float16)  # [n, super-blocks, 1]
    codes, scale = _unit_scaled(raw, _T.Q3_K)
    d = d16.astype(np.float32).repeat(16, axis=2).reshape(n, -1)  # per block of 16
    sub = np.rint(np.divide(scale, d, out=np.zeros_like(scale), where=d != 0)).astype(np.int8)
    table = np.concatenate((sub.view(np.uint8), d16.reshape(n, -1).view(np.uint8)), axis=1)
    return codes, np.ascontiguousarray(table)


# IQ4_NL's and IQ4_XS's table of values (llama.cpp's kvalues_iq4nl): a 4-bit code's value.
IQ4_VALUES = np.array(quants.IQ4_NL.kvalues, dtype=np.int8)


def _pairs(u: np.ndarray) -> np.ndarray:
    """Two bits of each of 64 codes [..., 64] (0..3) as 16 bytes: byte i codes i, i + 16, i + 32,
    i + 48 at bits 0-1, 2-3, 4-5, 6-7."""
    return u[..., :16] | (u[..., 16:32] << 2) | (u[..., 32:48] << 4) | (u[..., 48:] << 6)


def _unpairs(pairs: np.ndarray) -> np.ndarray:
    """The 64 two-bit codes of `_pairs`' 16 bytes [..., 16]."""
    return np.concatenate([(pairs >> (2 * i)) & 3 for i in range(4)], axis=-1)


def packed_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes int8 [N, K] (K a multiple of 64) in `bits` bits each, uint8 [N, K/64 * 8 * bits],
    the layout kernels/csrc/quant_int8.cpp's PackedBits reads: per 64 codes, 32 bytes of low
    nibbles (byte i: code i | code i + 32 << 4), then the high bits: 6 bits (codes within
    -32..31), 16 bytes of pairs (`_pairs`); 5 bits (-16..15), 8 bytes (bit j of them: code
    j's); 3 bits (-4..3), no nibbles: 16 bytes of the low pairs, then 8 bytes of the third
    bits; each code stored plus 2^(bits-1); 4 bits, the codes IQ4_VALUES' values, stored as
    their indices. ValueError for other bits, K or codes."""
    n, k = codes.shape
    bias = 1 << (bits - 1)
    if bits == 4:
        index = np.searchsorted(IQ4_VALUES, codes).clip(0, 15)
        fits = k % 64 == 0 and bool(np.all(IQ4_VALUES[index] == codes))
    else:
        fits = bits in (3, 5, 6) and k % 64 == 0 and codes.min(initial=0) >= -bias and \
            codes.max(initial=0) < bias
    if not fits:
        within = "IQ4's values" if bits == 4 else f"within [{-bias}, {bias - 1}]"
        raise ValueError(f"packed_codes: {bits}-bit codes of [{n}, {k}] need bits 3, 4, 5 or "
                         f"6, K a multiple of 64 and codes {within}")
    if bits == 4:
        u = index.astype(np.uint8).reshape(n, -1, 64)
        return np.ascontiguousarray((u[..., :32] | (u[..., 32:] << 4)).reshape(n, -1))
    u = (codes.astype(np.int16) + bias).astype(np.uint8).reshape(n, -1, 64)
    if bits == 3:
        third = np.packbits(u >> 2, axis=2, bitorder="little")
        return np.ascontiguousarray(np.concatenate((_pairs(u & 3), third), axis=2)
                                    .reshape(n, -1))
    low = (u[..., :32] & 15) | ((u[..., 32:] & 15) << 4)
    high = u >> 4
    tail = _pairs(high) if bits == 6 else np.packbits(high, axis=2, bitorder="little")
    return np.ascontiguousarray(np.concatenate((low, tail), axis=2).reshape(n, -1))


def unpacked_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The codes int8 [N, K] of `packed_codes(codes, bits)`."""
    n = packed.shape[0]
    chunks = packed.reshape(n, -1, 8 * bits)
    if bits == 3:
        u = _unpairs(chunks[..., :16]) | \
            (np.unpackbits(chunks[..., 16:], axis=2, bitorder="little") << 2)
        return (u.astype(np.int16) - 4).astype(np.int8).reshape(n, -1)
    low, tail = chunks[..., :32], chunks[..., 32:]
    if bits == 4:
        return IQ4_VALUES[np.concatenate((low & 15, low >> 4), axis=2)].reshape(n, -1)
    high = _unpairs(tail) if bits == 6 else np.unpackbits(tail, axis=2, bitorder="little")
    u = np.concatenate((low & 15, low >> 4), axis=2) | (high << 4)
    return (u.astype(np.int16) - (1 << (bits - 1))).astype(np.int8).reshape(n, -1)


def two_level_block_scales(table: np.ndarray) -> np.ndarray:
    """The float32 scales [N, K/16] of a `q6_k_two_level` table [N, K/16 + K/128]."""
    blocks = table.shape[1] * 8 // 9
    sub = np.ascontiguousarray(table[:, :blocks]).view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(table[:, blocks:]).view(np.float16).astype(np.float32)
    return np.repeat(d, 16, axis=1) * sub


def int8_codes_and_scales(raw: np.ndarray, ggml_type: GGMLQuantizationType
                          ) -> tuple[np.ndarray, np.ndarray, int]:
    """(codes int8 [N, K], scales float32 [N, K / block], block) of the rows `raw` (uint8 [N,
    bytes per row]) of a tensor in one of INT8_BLOCK_TYPES. ValueError for another type."""
    if ggml_type == _T.Q8_0:
        return (*_q8_0(raw), 32)
    if ggml_type in _UNIT_CODES:
        return (*_unit_scaled(raw, ggml_type), INT8_BLOCK_TYPES[ggml_type])
    raise ValueError(f"ggml type {ggml_type.name} is not an int8-block type; these are: "
                     f"{', '.join(sorted(t.name for t in INT8_BLOCK_TYPES))}")
