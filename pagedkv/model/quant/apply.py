"""Replacing a loaded model's linear layers by packed ones (the `quantization` option).

- "auto": a GGUF checkpoint's linears stored in a 4-bit type (`int4_blocks.INT4_TYPES`) stay
  packed (`Int4Linear`, built from the file's block bytes, exact); other types (Q8_0, Q6_K, F16
  ...) and the embeddings stay dequantized in the model dtype. Any other checkpoint: unchanged.
- "int8": every linear but the lm_head becomes `Int8Linear` (per-channel int8 of the loaded
  weight; for a GGUF checkpoint, its 4-bit linears stay `Int4Linear` as with "auto").
- "none": unchanged (every weight in the model dtype).
CPU only and without tensor parallelism (the caller checks); the lm_head (often tied to the
embeddings) keeps the model dtype: measured, no packed op beats the dense one on it at batch
1 by much (bench_quant_linear.py, 49152x576), and it stays exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedkv.model.gguf import gguf_file
from pagedkv.model.layers import Linear
from pagedkv.model.quant.int4_blocks import GROUP, INT4_TYPES, codes_and_scales
from pagedkv.model.quant.int4_linear import Int4Linear
from pagedkv.model.quant.int8_linear import Int8Linear

QUANTIZATION_MODES = ("auto", "none", "int8")


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, str, Linear]]:
    """(parent, attribute, qualified name, module) of every Linear but the lm_head."""
    out = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, Linear) and name != "lm_head":
                out.append((parent, attr, name, child))
    return out


def _gguf_int4(model: nn.Module, checkpoint: object, name: str, linear: Linear
               ) -> Int4Linear | None:
    """`linear` as an Int4Linear from the GGUF file's blocks, or None where its sources are
    not all 4-bit or its shape does not fit the int4 kernel."""
    sources = model.checkpoint_mapping().get(f"{name}.weight") if hasattr(
        model, "checkpoint_mapping") else None
    if not sources or linear.out_features % 16 or linear.in_features % GROUP:
        return None
    gguf = checkpoint.gguf
    from pagedkv.model.gguf.tensors import hf_rows

    parts = []
    for source in sources:
        gguf_name = checkpoint.gguf_name(source)
        ggml_type = gguf.tensors[gguf_name].ggml_type
        if ggml_type not in INT4_TYPES:
            return None
        parts.append(codes_and_scales(hf_rows(gguf, source, gguf_name), ggml_type))
    nibbles, scale, zero = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
    return Int4Linear(nibbles, scale, zero, linear.bias)


def quantize_model(model: nn.Module, model_dir: str | Path, mode: str) -> int:
    """Replace `model`'s linears per `mode` (see the module docstring; mutates `model`).
    Returns how many were replaced. ValueError naming an unknown mode."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if mode == "none":
        return 0
    checkpoint = None
    path = gguf_file(model_dir)
    if path is not None:
        from pagedkv.model.gguf.file import open_gguf
        from pagedkv.model.gguf.tensors import GGUFCheckpoint

        checkpoint = GGUFCheckpoint(open_gguf(path))
    replaced = 0
    with torch.no_grad():
        for parent, attr, name, linear in _linears(model):
            packed: nn.Module | None = None
            if checkpoint is not None:
                packed = _gguf_int4(model, checkpoint, name, linear)
            if packed is None and mode == "int8":
                packed = Int8Linear(linear.weight, linear.bias)
            if packed is not None:
                setattr(parent, attr, packed)
                replaced += 1
    return replaced
