"""fp8 KV cache scales taken from a checkpoint that carries them, as vLLM reads them.

A checkpoint quantized for an fp8 KV cache (llm-compressor, ModelOpt, AutoFP8) stores each
attention layer's calibrated scales beside its weights, a stored fp8 value x8 meaning
x8 * scale, under one of these names (vLLM's `maybe_remap_kv_scale_name` accepts the same):
- `model.layers.{i}.self_attn.k_scale` / `.v_scale` (also `.self_attn.attn.k_scale`): today's;
- `model.layers.{i}.self_attn.k_proj.output_scale` / `v_proj.output_scale`: the older form;
- `model.layers.{i}.self_attn.kv_scale`: one scale for both keys and values (older still).
A scale is a scalar (one per layer) or has one value per KV head ([num_kv_heads], per-head
scales). When they are present the runner uses them instead of computing its own
(kv_calibration.py); every layer must have both, each finite and > 0.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pagedkv.model.kv_quant import KVScales, Scale
from pagedkv.model.loader import open_weights, weight_files

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(.+)$")
# Suffix after `self_attn.` -> which scales it gives ("k", "v" or both).
SUFFIXES = {"k_scale": "k", "v_scale": "v", "attn.k_scale": "k", "attn.v_scale": "v",
            "k_proj.output_scale": "k", "v_proj.output_scale": "v", "kv_scale": "kv"}


def _scale_tensors(model_dir: str | Path) -> dict[tuple[int, str], tuple[str, torch.Tensor]]:
    """(layer, "k" / "v") -> (checkpoint name, tensor) of every KV scale in the checkpoint."""
    found: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for path in weight_files(model_dir):
        with open_weights(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                match = _LAYER.search(name)
                which = SUFFIXES.get(match.group(2)) if match else None
                if which is not None:
                    tensor = f.get_tensor(name).float()
                    for kind in which:
                        found[(int(match.group(1)), kind)] = (name, tensor)
    return found


def _to_scale(name: str, tensor: torch.Tensor, num_kv_heads: int,
              heads: slice | None) -> Scale:
    """One layer's scale from its checkpoint tensor: a float, or a tuple per KV head of this
    rank (`heads`: the rank's slice of the KV heads; None: all). ValueError names a bad one."""
    values = tensor.flatten()
    if not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ValueError(f"checkpoint KV scale {name!r} must be finite and > 0, got "
                         f"{values.tolist()}")
    if values.numel() == 1:
        return float(values[0])
    if values.numel() != num_kv_heads:
        raise ValueError(f"checkpoint KV scale {name!r} has {values.numel()} values; expected "
                         f"1 or one per KV head ({num_kv_heads})")
    if heads is None:
        return tuple(float(x) for x in values)
    mine = values[heads]
    if mine.numel() == 0:  # KV heads replicated over more ranks than heads: the largest
        return float(values.max())
    return tuple(float(x) for x in mine)


def read_checkpoint_kv_scales(model_dir: str | Path, num_layers: int, num_kv_heads: int,
                              heads: slice | None = None) -> list[KVScales] | None:
    """Each layer's KVScales from the checkpoint in `model_dir`, or None when it carries no
    KV scales. `num_kv_heads`: the model's (all ranks'); `heads`: this tensor-parallel rank's
    KV heads (None: all). Raises ValueError naming a layer without both scales, or a scale
    that is not finite and > 0 or has the wrong number of values."""
    found = _scale_tensors(model_dir)
    if not found:
        return None
    scales = []
    for layer in range(num_layers):
        for kind in "kv":
            if (layer, kind) not in found:
                raise ValueError(f"the checkpoint in {model_dir} has KV cache scales but none "
                                 f"for layer {layer}'s {'keys' if kind == 'k' else 'values'}")
        k_name, k = found[(layer, "k")]
        v_name, v = found[(layer, "v")]
        k_scale = _to_scale(k_name, k, num_kv_heads, heads)
        v_scale = _to_scale(v_name, v, num_kv_heads, heads)
        if isinstance(k_scale, tuple) != isinstance(v_scale, tuple):  # one per head, one not
            n = len(k_scale) if isinstance(k_scale, tuple) else len(v_scale)
            k_scale = k_scale if isinstance(k_scale, tuple) else (k_scale,) * n
            v_scale = v_scale if isinstance(v_scale, tuple) else (v_scale,) * n
        scales.append(KVScales(k_scale, v_scale))
    return scales
