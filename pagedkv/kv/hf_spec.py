"""kv_cache_spec_from_hf_config: the KV cache spec a Hugging Face `config.json` calls for
(spec.py's kinds, or hybrid_spec.py's grouped spec for layers of mixed attention types)."""

from __future__ import annotations

from typing import Any

from pagedkv.config.dtypes import kv_scale_bytes, resolve_dtype, resolve_kv_cache_dtype
from pagedkv.config.hf_config import HFModelConfig
from pagedkv.kv.hybrid_spec import hybrid_kv_cache_spec
from pagedkv.kv.spec import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    check_positive_int,
)


def kv_cache_spec_from_hf_config(
    config: dict[str, Any] | HFModelConfig, block_size: int = 16, dtype: str = "auto",
    cache_dtype: str = "auto", hybrid: bool = True,
) -> KVCacheSpec:
    """Build the KV cache spec of a Hugging Face `config.json` (a parsed dict, or the
    `HFModelConfig` read from it: the one reader the model uses too).

    MLA (`kv_lora_rank` set, DeepSeek-V2/V3): MLAAttentionSpec. Every layer sliding with one
    window: SlidingWindowSpec. Layers of mixed types (Qwen2 `max_window_layers`, Gemma's
    alternating layers): HybridKVCacheSpec, one KV cache group per attention type over one
    pool (hybrid_spec.py), unless `hybrid` is False (vLLM's
    --disable-hybrid-kv-cache-manager): then every layer keeps full-attention blocks, an upper
    bound, while the model still applies each layer's window. Otherwise FullAttentionSpec.
    `dtype` is the model's dtype ("auto": the config's); `cache_dtype` the KV cache's (vLLM's
    `kv_cache_dtype`: "auto" = the model's, "fp8" / "fp8_e4m3" / "fp8_e5m2" / "int8", one
    byte per value, int8 plus a scale per token and head, or a model dtype name), which is the
    spec's `dtype`. Raises ValueError naming the missing or invalid key.
    """
    check_positive_int("block_size", block_size)
    hf = config if isinstance(config, HFModelConfig) else HFModelConfig.from_dict(config)
    model_dtype = resolve_dtype(dtype, hf.raw)
    if kv_scale_bytes(model_dtype):  # int8 needs per-token scales: a cache format only
        raise ValueError(f"dtype {dtype!r} is a KV cache format (kv_cache_dtype), not a dtype")
    kv_dtype = resolve_kv_cache_dtype(cache_dtype, model_dtype)
    if hf.is_mla:
        return MLAAttentionSpec(
            block_size=block_size,
            kv_lora_rank=hf.kv_lora_rank,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            dtype=kv_dtype,
            num_layers=hf.num_layers,
        )
    shape = dict(block_size=block_size, num_kv_heads=hf.num_kv_heads, head_size=hf.head_dim,
                 dtype=kv_dtype, num_layers=hf.num_layers)
    if hf.sliding_window is not None:
        return SlidingWindowSpec(**shape, sliding_window=hf.sliding_window)
    grouped = hybrid_kv_cache_spec(hf.layer_sliding_windows, **{
        k: v for k, v in shape.items() if k != "num_layers"}) if hybrid else None
    return grouped if grouped is not None else FullAttentionSpec(**shape)
