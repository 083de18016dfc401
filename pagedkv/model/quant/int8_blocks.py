"""GGUF's 8-bit and 6-bit block formats read as one shape: an int8 code per weight and a float32
scale per block of 16 or 32 along a row, weight = code * scale (exactly the file's values).

llama.cpp's ggml-common.h block layouts:
- Q8_0: blocks of 32 = fp16 d, 32 int8 codes; w = d * q (block 32, scale d);
- Q6_K: super-blocks of 256 = 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
  sub-scales, fp16 d; w = d * sc[i // 16] * (q - 32) with q 6 bits (block 16, scale d * sc:
  an fp16 times an int8 is exact in float32, and q - 32 is within [-32, 31]).
Q6_K's codes are recovered from the `gguf` package's own dequantization (w / scale, rounded:
exact, as |q - 32| <= 32 and w is d * sc * (q - 32) rounded once in float32).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, quants

# ggml type -> block size of its scales.
INT8_BLOCK_TYPES = {GGMLQuantizationType.Q8_0: 32, GGMLQuantizationType.Q6_K: 16}


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return codes.reshape(n, -1), _fp16(blocks[..., 0:2])


def _q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = raw.shape[0]
    blocks = raw.reshape(-1, 210)
    d = _fp16(blocks[:, 208:210])
    sub = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    scale = (d[:, None] * sub).reshape(n, -1)  # [N, K / 16]
    w = quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType.Q6_K)
    w = w.reshape(n, -1, 16).astype(np.float32)
    safe = np.where(scale == 0, 1, scale)[..., None]
    codes = np.where(scale[..., None] == 0, 0, np.rint(w / safe)).astype(np.int8)
    return codes.reshape(n, -1), scale


def int8_codes_and_scales(raw: np.ndarray, ggml_type: GGMLQuantizationType
                          ) -> tuple[np.ndarray, np.ndarray, int]:
    """(codes int8 [N, K], scales float32 [N, K / block], block) of a Q8_0 or Q6_K tensor's
    rows `raw` (uint8 [N, bytes per row]). ValueError for another type."""
    if ggml_type == GGMLQuantizationType.Q8_0:
        return (*_q8_0(raw), 32)
    if ggml_type == GGMLQuantizationType.Q6_K:
        return (*_q6_k(raw), 16)
    raise ValueError(f"ggml type {ggml_type.name} is not an int8-block type; these are: "
                     f"{', '.join(sorted(t.name for t in INT8_BLOCK_TYPES))}")
