"""Replacing a loaded model's linear layers by packed ones (the `quantization` option).

- "auto": with a 16-bit model dtype (`PACKED_AUTO_DTYPES`), a GGUF checkpoint's linears stored
  in a 4-bit type (`int4_blocks.INT4_TYPES`) stay packed (`Int4Linear`, built from the file's
  block bytes, exact); those in Q8_0 / Q6_K / Q5_0, and such a token
  embedding table and LM head, stay packed as int8 codes with per-block scales (int8_gguf.py:
  exact); other types (F16 ...) stay dequantized in the model dtype. Any other checkpoint:
  unchanged.
- "int8": every linear but the lm_head becomes `Int8Linear` (per-channel int8 of the loaded
  weight; for a GGUF checkpoint, its 4-bit linears stay `Int4Linear` as with "auto").
- "none": unchanged (every weight in the model dtype).
CPU only and without tensor parallelism (the caller, loader.load_model, checks): the GGUF
linears are built before the weights are read (`pack_gguf_linears`: never dequantized), the
int8 ones after (`quantize_int8`). Where either packed some linears, the lm_head (often tied
to the embeddings) keeps its dense weight and gains a per-row int8 copy for decode-sized calls
(`pack_head`, packed_head.py: about 2x the dense matmul at 1-2 rows).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedkv.model.gguf import gguf_file
from pagedkv.model.gguf.config import FLOAT_DTYPES
from pagedkv.model.layers import Linear
from pagedkv.model.quant.gguf_parts import gguf_parts
from pagedkv.model.quant.int4_blocks import GROUP, INT4_TYPES, codes_and_scales, q4_k_two_level
from pagedkv.model.quant.int4_linear import Int4Linear
from pagedkv.model.quant.int8_gguf import gguf_int8_block_linear, pack_gguf_vocab
from pagedkv.model.quant.int8_linear import Int8Linear
from pagedkv.model.quant.packed_head import pack_head

__all__ = ["pack_gguf_linears", "pack_head", "quantize_int8"]

QUANTIZATION_MODES = ("auto", "none", "int8")
logger = logging.getLogger("pagedkv.model.loader")
# The model dtypes "auto" packs at (float32 stays exact: the int4 kernel rounds activations to
# bfloat16, and its float32 path is 10-60x slower).
PACKED_AUTO_DTYPES = (torch.bfloat16, torch.float16)


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, str, Linear]]:
    """(parent, attribute, qualified name, module) of every Linear but the lm_head."""
    out = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, Linear) and name != "lm_head":
                out.append((parent, attr, name, child))
    return out


def _gguf_int4(checkpoint: Any, sources: list[str], linear: Linear) -> Int4Linear | None:
    """`linear` as an Int4Linear from the GGUF blocks of `sources` (concatenated rows), or None
    where they are not all 4-bit or its shape does not fit the int4 kernel; where they are all
    Q4_K, with the file's two levels of scales (`Int4Linear.from_two_level`). Its bias (if
    any) is a parameter still to be loaded."""
    if linear.out_features % 16 or linear.in_features % GROUP:
        return None
    bias = None if linear.bias is None else torch.zeros_like(linear.bias)
    if linear.in_features % 256 == 0:  # every part Q4_K: its scales kept in two levels
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


def pack_gguf_linears(model: nn.Module, model_dir: str | Path) -> frozenset[str]:
    """Before the weights are loaded: replace each linear of `model` whose GGUF tensors are
    4-bit by an Int4Linear built from the file's blocks (mutates `model`). Returns the
    checkpoint-mapping names now built (`loader.load_weights(preloaded=...)`: neither read nor
    dequantized); empty for a checkpoint that is not GGUF."""
    path = gguf_file(model_dir)
    if path is None:
        return frozenset()
    from pagedkv.model.gguf.file import open_gguf
    from pagedkv.model.gguf.tensors import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(open_gguf(path))
    mapping = model.checkpoint_mapping()
    built, unpacked = set(), {}
    for parent, attr, name, linear in _linears(model):
        sources = mapping.get(f"{name}.weight")
        packed = (_gguf_int4(checkpoint, sources, linear)
                  or gguf_int8_block_linear(checkpoint, sources, linear)) if sources else None
        if packed is not None:
            setattr(parent, attr, packed)
            built.add(f"{name}.weight")
        elif sources:
            types = {checkpoint.gguf.tensors[checkpoint.gguf_name(s)].type_name for s in sources}
            if not types <= FLOAT_DTYPES.keys():
                unpacked[name] = "+".join(sorted(types))
    if unpacked:
        kinds = sorted(set(unpacked.values()))
        logger.warning("%d of the GGUF file's quantized linears are dequantized to the model "
                       "dtype (no packed kernel for their parts' types together: %s), e.g. %s",
                       len(unpacked), ", ".join(kinds), next(iter(unpacked)))
    return frozenset(built) | pack_gguf_vocab(model, checkpoint)


def quantize_int8(model: nn.Module) -> int:
    """After the weights are loaded: replace every remaining Linear but the lm_head by an
    Int8Linear of its weight (mutates `model`). Returns how many."""
    linears = _linears(model)
    with torch.no_grad():
        for parent, attr, _, linear in linears:
            setattr(parent, attr, Int8Linear(linear.weight, linear.bias))
    return len(linears)
