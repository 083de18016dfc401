"""GGUF's 8-bit, 6-bit and symmetric 5-bit block formats read as one shape: an int8 code per
weight and a float32 scale per block of 16 or 32 along a row, weight = code * scale (exactly the
file's values).

llama.cpp's ggml-common.h block layouts:
- Q8_0: blocks of 32 = fp16 d, 32 int8 codes; w = d * q (block 32, scale d);
- Q5_0: blocks of 32 = fp16 d, 32 high bits, 16 bytes of low nibbles; w = d * (q - 16) with q
  5 bits (block 32, scale d, codes -16..15: the byte a code takes costs 1.0625 bytes a weight
  against the file's 0.6875, half of bfloat16's; llama.cpp falls back to Q5_0 in Q4_K mixes
  for rows that are not a multiple of 256, as SmolLM2's 576);
- Q6_K: super-blocks of 256 = 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
  sub-scales, fp16 d; w = d * sc[i // 16] * (q - 32) with q 6 bits (block 16, scale d * sc:
  an fp16 times an int8 is exact in float32, and q - 32 is within [-32, 31]).
Q6_K's and Q5_0's codes are recovered from the `gguf` package's own dequantization (w / scale,
rounded: exact, as |code| <= 32 and w is the scale times the code rounded once in float32).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

# ggml type -> block size of its scales.
INT8_BLOCK_TYPES = {GGMLQuantizationType.Q8_0: 32, GGMLQuantizationType.Q6_K: 16,
                    GGMLQuantizationType.Q5_0: 32}


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return codes.reshape(n, -1), _fp16(blocks[..., 0:2])


def _codes_of(raw: np.ndarray, ggml_type: GGMLQuantizationType, scale: np.ndarray
              ) -> np.ndarray:
    """int8 codes [N, K] of `raw` given its scales [N, K / block]: the gguf package's
    dequantized weights over their block's scale, rounded (0 where the scale is 0)."""
    n = raw.shape[0]
    w = quants.dequantize(np.ascontiguousarray(raw), ggml_type)
    w = w.reshape(n, scale.shape[1], -1).astype(np.float32)
    safe = np.where(scale == 0, 1, scale)[..., None]
    return np.where(scale[..., None] == 0, 0, np.rint(w / safe)).astype(np.int8).reshape(n, -1)


def _q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = raw.shape[0]
    blocks = raw.reshape(-1, 210)
    d = _fp16(blocks[:, 208:210])
    sub = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    scale = (d[:, None] * sub).reshape(n, -1)  # [N, K / 16]
    return _codes_of(raw, GGMLQuantizationType.Q6_K, scale), scale


def _q5_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = raw.shape[0]
    scale = _fp16(raw.reshape(n, -1, 22)[..., 0:2])  # [N, K / 32]
    return _codes_of(raw, GGMLQuantizationType.Q5_0, scale), scale


def int8_codes_and_scales(raw: np.ndarray, ggml_type: GGMLQuantizationType
                          ) -> tuple[np.ndarray, np.ndarray, int]:
    """(codes int8 [N, K], scales float32 [N, K / block], block) of a Q8_0, Q6_K or Q5_0
    tensor's rows `raw` (uint8 [N, bytes per row]). ValueError for another type."""
    if ggml_type == GGMLQuantizationType.Q8_0:
        return (*_q8_0(raw), 32)
    if ggml_type == GGMLQuantizationType.Q6_K:
        return (*_q6_k(raw), 16)
    if ggml_type == GGMLQuantizationType.Q5_0:
        return (*_q5_0(raw), 32)
    raise ValueError(f"ggml type {ggml_type.name} is not an int8-block type; these are: "
                     f"{', '.join(sorted(t.name for t in INT8_BLOCK_TYPES))}")
