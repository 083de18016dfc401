"""Replacing a loaded model's linear layers by packed ones (the `quantization` option).

- "auto": with a 16-bit model dtype (`PACKED_AUTO_DTYPES`), a GGUF checkpoint's linears stored
  in a 4- or 5-bit type with offsets (`int4_blocks.INT4_TYPES`) stay packed (`Int4Linear`,
  built from the file's block bytes, exact); those in Q8_0 / Q6_K / Q5_0 / Q3_K / IQ4
  (int8_blocks.INT8_BLOCK_TYPES) stay packed as int8-block codes with per-block scales
  (int8_gguf.py: exact); a token embedding table and LM head in either family stay packed
  too (vocab.py); a fused linear whose parts mix the two (Q4_K_M's Q4_K q/k and Q6_K v)
  stays packed as one linear of each per run of parts (`PartsLinear`, parts_linear.py); other
  types (F16 ...) stay dequantized in the model dtype. Any other checkpoint: unchanged.
  A GPTQ or AWQ checkpoint's 4-bit linears (prequantized.py) stay packed as `Int4Linear`
  likewise (exact), where their groups are runs of consecutive input features; the others
  (GPTQ's 2- and 8-bit codes, `desc_act` groups) are dequantized to the model dtype.
- "gptq", "awq": "auto" for a checkpoint of that method, a ValueError for any other (vLLM's
  `--quantization` names the checkpoint's method too).
- "int8": every linear but the lm_head becomes `Int8Linear` (per-channel int8 of the loaded
  weight; a GGUF, GPTQ or AWQ checkpoint's 4-bit linears stay `Int4Linear` as with "auto").
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

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedkv.config.options import QUANTIZATION_CHOICES
from pagedkv.model.gguf import gguf_file
from pagedkv.model.gguf.config import FLOAT_DTYPES
from pagedkv.model.layers import Linear
from pagedkv.model.quant.gguf_parts import gguf_types
from pagedkv.model.quant.int4_gguf import gguf_int4_linear
from pagedkv.model.quant.int8_gguf import gguf_int8_block_linear
from pagedkv.model.quant.int8_linear import Int8Linear
from pagedkv.model.quant.packed_head import pack_head
from pagedkv.model.quant.parts_linear import gguf_parts_linear
from pagedkv.model.quant.prequantized import (
    PrequantizedFormat,
    fold_act_orders,
    method_named,
    prequantized_int4_linear,
)
from pagedkv.model.quant.vocab import pack_gguf_vocab

__all__ = ["check_quantization", "pack_gguf_linears", "pack_head", "pack_prequantized_linears",
           "quantize_int8"]

logger = logging.getLogger("pagedkv.model.loader")
# The model dtypes "auto" packs at (float32 stays exact: the int4 kernel rounds activations to
# bfloat16, and its float32 path is 10-60x slower).
PACKED_AUTO_DTYPES = (torch.bfloat16, torch.float16)
# The packed builders tried in turn on a linear's GGUF tensors: all 4-bit, all int8 blocks, then
# runs of each (a fused linear's parts: parts_linear.py).
_GGUF_BUILDERS = (gguf_int4_linear, gguf_int8_block_linear, gguf_parts_linear)


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, str, Linear]]:
    """(parent, attribute, qualified name, module) of every Linear but the lm_head."""
    out = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, Linear) and name != "lm_head":
                out.append((parent, attr, name, child))
    return out


def pack_gguf_linears(model: nn.Module, model_dir: str | Path) -> frozenset[str]:
    """Before the weights are loaded: replace each linear of `model` whose GGUF tensors are
    packable by a packed module built from the file's blocks (`_GGUF_BUILDERS`: Int4Linear,
    Int8BlockLinear, or a PartsLinear of both), and such a token embedding table and LM head
    (vocab.pack_gguf_vocab) (mutates `model`); logs a warning naming the quantized ones
    left to be dequantized. Returns the checkpoint-mapping names now built
    (`loader.load_weights(preloaded=...)`: neither read nor dequantized); empty for a
    checkpoint that is not GGUF."""
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
        packed = None
        for build in _GGUF_BUILDERS if sources else ():
            packed = build(checkpoint, sources, linear.in_features, linear.bias)
            if packed is not None:
                break
        if packed is not None:
            setattr(parent, attr, packed)
            built.add(f"{name}.weight")
        elif sources:
            types = {GGMLQuantizationType(t).name for t in gguf_types(checkpoint, sources)}
            if not types <= FLOAT_DTYPES.keys():
                unpacked[name] = "+".join(sorted(types))
    if unpacked:
        kinds = sorted(set(unpacked.values()))
        logger.warning("%d of the GGUF file's quantized linears are dequantized to the model "
                       "dtype (a part's type without a packed kernel, or a shape off its "
                       "kernel's: %s), e.g. %s",
                       len(unpacked), ", ".join(kinds), next(iter(unpacked)))
    return frozenset(built) | pack_gguf_vocab(model, checkpoint)


def check_quantization(quantization: str, fmt: PrequantizedFormat | None,
                       model_dir: str | Path) -> None:
    """ValueError unless `quantization` is one of the modes, and "gptq" / "awq" name the
    method of `model_dir`'s checkpoint (`fmt`: how its config says it is stored)."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, "
                         f"got {quantization!r}")
    method = None if fmt is None else fmt.method
    if quantization in ("gptq", "awq") and method != quantization:
        stored = "a checkpoint of float weights" if method is None else \
            f"{method_named(method)} checkpoint"
        raise ValueError(f"quantization={quantization!r} asks for {method_named(quantization)} "
                         f"checkpoint, but {model_dir} is {stored}: use quantization='auto'")


def pack_prequantized_linears(model: nn.Module, state: Any,
                              fmt: PrequantizedFormat) -> frozenset[str]:
    """Before the weights are loaded: replace each linear of `model` whose GPTQ / AWQ tensors
    (`state`: the checkpoint's stored tensors by name, `in` and `[name]`) pack
    (prequantized.prequantized_int4_linear) by an Int4Linear on its stored codes, a GPTQ act
    order folded where it can be (prequantized.fold_act_orders) (mutates `model`); logs a
    warning naming the quantized ones left to be dequantized. Returns the checkpoint-mapping
    names now built (`loader.load_weights(preloaded=...)`)."""
    mapping = model.checkpoint_mapping()
    built, unpacked = set(), []
    for parent, attr, name, linear in _linears(model):
        sources = mapping.get(f"{name}.weight") or []
        if not any(s.removesuffix(".weight") + ".qweight" in state for s in sources):
            continue
        packed = prequantized_int4_linear(fmt, state, sources, linear.in_features, linear.bias)
        if packed is None:
            unpacked.append(name)
            continue
        setattr(parent, attr, packed)
        built.add(f"{name}.weight")
    fold_act_orders(model)
    if unpacked:
        logger.warning("%d of the %s checkpoint's quantized linears are dequantized to the "
                       "model dtype (%s; packed: 4-bit codes, groups of whole runs of 32 input "
                       "features, fused parts in one act order, rows a multiple of 16), e.g. %s",
                       len(unpacked), fmt.method.upper(), fmt.describe(), unpacked[0])
    return frozenset(built)


def quantize_int8(model: nn.Module) -> int:
    """After the weights are loaded: replace every remaining Linear but the lm_head by an
    Int8Linear of its weight (mutates `model`). Returns how many."""
    linears = _linears(model)
    with torch.no_grad():
        for parent, attr, _, linear in linears:
            setattr(parent, attr, Int8Linear(linear.weight, linear.bias))
    return len(linears)
