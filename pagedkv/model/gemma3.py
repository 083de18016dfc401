"""Gemma 3 (text): the Gemma 2 layers (gemma2.py) with an RMSNorm on each head's query and key,
no soft-capping by default, and two RoPEs: sliding-window layers rotate with the local base
(`rope_local_base_freq`, 10,000), full layers with the global one (`rope_theta`, 1,000,000, with
its scaling). Five sliding layers per full one (`sliding_window_pattern` 6, or `layer_types`),
so the KV cache keeps the window's blocks only for five layers in six (kv/hybrid_spec.py).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.model.config import ModelConfig
from pagedkv.model.gemma2 import Gemma2ForCausalLM
from pagedkv.model.layers import RotaryEmbedding
from pagedkv.model.ops import RopeInputs
from pagedkv.model.parallel.group import TensorParallelGroup

_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def gemma3_rope(raw: dict[str, Any], layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) of a layer type, from transformers' `rope_parameters` by layer
    type, or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling` keys."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        p = dict(params[layer_type])
    elif layer_type == "full_attention":
        p = dict(raw.get("rope_scaling") or {})
        p.setdefault("rope_theta", raw.get("rope_theta", _DEFAULT_THETA[layer_type]))
    else:
        p = {"rope_theta": raw.get("rope_local_base_freq", _DEFAULT_THETA[layer_type])}
    theta = float(p.pop("rope_theta", _DEFAULT_THETA[layer_type]))
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3") or "factor" not in p:
        raise ValueError(f"unsupported Gemma 3 RoPE parameters {p!r} for {layer_type}")
    return theta, {**{k: v for k, v in p.items() if k != "type"}, "rope_type": rope_type}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(cfg, tp)
        raw = cfg.hf_config.raw if cfg.hf_config is not None else {}
        self.rotary = RotaryEmbedding(cfg.head_dim, *gemma3_rope(raw, "full_attention"),
                                      cfg.max_position_embeddings)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, *gemma3_rope(raw, "sliding_attention"),
                                            cfg.max_position_embeddings)

    def layer_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[RopeInputs]:
        full = self.rotary.inputs(positions, dtype)
        local = self.rotary_local.inputs(positions, dtype)
        return [full if layer.self_attn.window is None else local for layer in self.layers]
