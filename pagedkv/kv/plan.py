"""Capacity planning: how many KV blocks a memory budget holds.

    num_blocks      = floor((memory * utilization - weights - activation_peak) / page_size_bytes)
    num_host_blocks = swap_space // page_size_bytes

as vLLM's `profile_num_available_blocks`, except that weights and the activation peak are
estimated from the config here (or given) instead of measured by a profiling forward pass.
Pure Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedkv.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DTYPE_BYTES,
    config_int,
    resolve_dtype,
    text_config,
)
from pagedkv.kv.sizes import format_size
from pagedkv.kv.spec import KVCacheSpec


@dataclass(frozen=True)
class KVCachePlan:
    """The outcome of `plan_num_blocks`: block counts and what they mean for requests.

    `max_blocks_per_seq` and `max_concurrent_seqs` are None when no max_model_len was given.
    """

    spec: KVCacheSpec
    memory_bytes: int
    utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    swap_space_bytes: int
    max_model_len: int | None
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    num_host_blocks: int
    max_cached_tokens: int
    max_blocks_per_seq: int | None
    max_concurrent_seqs: int | None
    kv_cache_bytes: int
    host_kv_cache_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: every figure plus the spec (kind, layers, heads, dtype, ...)."""
        return {
            "kind": self.spec.kind,
            "spec": self.spec.to_dict(),
            "block_size": self.spec.block_size,
            "dtype": self.spec.dtype,
            "memory_bytes": self.memory_bytes,
            "utilization": self.utilization,
            "weights_bytes": self.weights_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "swap_space_bytes": self.swap_space_bytes,
            "max_model_len": self.max_model_len,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "num_host_blocks": self.num_host_blocks,
            "max_cached_tokens": self.max_cached_tokens,
            "max_blocks_per_seq": self.max_blocks_per_seq,
            "max_concurrent_seqs": self.max_concurrent_seqs,
            "kv_cache_bytes": self.kv_cache_bytes,
            "host_kv_cache_bytes": self.host_kv_cache_bytes,
        }


def _non_negative_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer of bytes, got {value!r}")
    return value


def plan_num_blocks(
    spec: KVCacheSpec,
    *,
    memory_bytes: int,
    utilization: float = 0.9,
    weights_bytes: int = 0,
    activation_peak_bytes: int = 0,
    swap_space_bytes: int = 0,
    max_model_len: int | None = None,
) -> KVCachePlan:
    """Split a memory budget into KV cache blocks of `spec.page_size_bytes` each.

    Raises ValueError for bad arguments, and (with the figures) when the budget does not hold
    the blocks of one `max_model_len` sequence (or, without max_model_len, not one block).
    """
    if not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool) or memory_bytes <= 0:
        raise ValueError(f"memory_bytes must be a positive integer, got {memory_bytes!r}")
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not (
        0.0 < utilization <= 1.0
    ):
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    _non_negative_int("weights_bytes", weights_bytes)
    _non_negative_int("activation_peak_bytes", activation_peak_bytes)
    _non_negative_int("swap_space_bytes", swap_space_bytes)

    page = spec.page_size_bytes
    available = math.floor(memory_bytes * utilization) - weights_bytes - activation_peak_bytes
    num_blocks = max(available // page, 0)
    num_host_blocks = swap_space_bytes // page

    budget = (
        f"{format_size(memory_bytes)} x {utilization:g} - weights {format_size(weights_bytes)}"
        f" - activations {format_size(activation_peak_bytes)} = {format_size(available)}"
    )
    if max_model_len is None:
        max_blocks_per_seq = max_concurrent_seqs = None
        if num_blocks < 1:
            raise ValueError(
                f"not even one KV block ({format_size(page)}) fits: budget {budget}"
            )
    else:
        max_blocks_per_seq = spec.max_blocks_per_seq(max_model_len)
        if num_blocks < max_blocks_per_seq:
            raise ValueError(
                f"need {max_blocks_per_seq} blocks ({format_size(max_blocks_per_seq * page)}) "
                f"for one sequence of max_model_len={max_model_len}, budget gives {num_blocks} "
                f"({budget}); lower max_model_len or give more memory"
            )
        max_concurrent_seqs = num_blocks // max_blocks_per_seq

    return KVCachePlan(
        spec=spec,
        memory_bytes=memory_bytes,
        utilization=float(utilization),
        weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak_bytes,
        swap_space_bytes=swap_space_bytes,
        max_model_len=max_model_len,
        bytes_per_token=spec.bytes_per_token,
        bytes_per_block=page,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        max_cached_tokens=num_blocks * spec.block_size,
        max_blocks_per_seq=max_blocks_per_seq,
        max_concurrent_seqs=max_concurrent_seqs,
        kv_cache_bytes=num_blocks * page,
        host_kv_cache_bytes=num_host_blocks * page,
    )


# ---------------------------------------------------------------- estimates from a config


def _mlp_params(hidden: int, intermediate: int) -> int:
    """Gated MLP (gate, up, down projections)."""
    return 3 * hidden * intermediate


def _attention_params(config: dict[str, Any], hidden: int) -> int:
    """Attention weights of one layer: q, k, v, o (+ biases, q/k norms); MLA's projections."""
    num_heads = config_int(config, "num_attention_heads")
    if config.get("kv_lora_rank") is not None:  # DeepSeek-V2/V3 MLA
        kv_lora_rank = config_int(config, "kv_lora_rank")
        rope = config_int(config, "qk_rope_head_dim")
        nope = config_int(config, "qk_nope_head_dim", default=128)
        v_head = config_int(config, "v_head_dim", default=nope)
        q_head = nope + rope
        if config.get("q_lora_rank") is not None:
            q_lora_rank = config_int(config, "q_lora_rank")
            q = hidden * q_lora_rank + q_lora_rank + q_lora_rank * num_heads * q_head
        else:
            q = hidden * num_heads * q_head
        kv_a = hidden * (kv_lora_rank + rope) + kv_lora_rank
        kv_b = kv_lora_rank * num_heads * (nope + v_head)
        return q + kv_a + kv_b + num_heads * v_head * hidden
    num_kv_heads = config_int(config, "num_key_value_heads", default=num_heads)
    head_dim = config_int(config, "head_dim", default=hidden // num_heads)
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    params = hidden * (q_out + 2 * kv_out) + q_out * hidden
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        params += q_out + 2 * kv_out  # Qwen2 always has q/k/v biases
    if str(config.get("model_type") or "").startswith("qwen3"):
        params += 2 * head_dim  # q_norm and k_norm
    return params


def _layer_mlp_params(config: dict[str, Any], hidden: int, layer: int) -> int:
    """MLP (dense or mixture of experts with router and shared experts) of one layer."""
    intermediate = config_int(config, "intermediate_size")
    if config.get("n_routed_experts"):  # DeepSeek MoE
        if layer < config.get("first_k_dense_replace", 0):
            return _mlp_params(hidden, intermediate)
        n_routed = config_int(config, "n_routed_experts")
        moe = config_int(config, "moe_intermediate_size")
        shared = config.get("n_shared_experts") or 0
        return (n_routed + shared) * _mlp_params(hidden, moe) + hidden * n_routed
    if config.get("num_local_experts"):  # Mixtral
        experts = config_int(config, "num_local_experts")
        return experts * _mlp_params(hidden, intermediate) + hidden * experts
    if config.get("num_experts") and config.get("moe_intermediate_size"):  # Qwen2/3-MoE
        experts = config_int(config, "num_experts")
        params = experts * _mlp_params(hidden, config_int(config, "moe_intermediate_size"))
        params += hidden * experts
        shared = config.get("shared_expert_intermediate_size") or 0
        if shared:
            params += _mlp_params(hidden, shared) + hidden  # shared expert and its gate
        return params
    return _mlp_params(hidden, intermediate)


def estimate_num_params(config: dict[str, Any]) -> int:
    """Parameter count of a decoder-only config: embeddings, lm_head unless tied, per layer
    attention (GQA, MLA), MLP (dense or MoE) and two norms, and the final norm."""
    config = text_config(config)
    hidden = config_int(config, "hidden_size")
    vocab = config_int(config, "vocab_size")
    num_layers = config_int(config, "num_hidden_layers")
    attention = _attention_params(config, hidden)
    params = vocab * hidden  # embed_tokens
    if not config.get("tie_word_embeddings", False):
        params += vocab * hidden  # lm_head
    for layer in range(num_layers):
        params += attention + _layer_mlp_params(config, hidden, layer) + 2 * hidden
    return params + hidden  # final norm


def estimate_weights_bytes(config: dict[str, Any], dtype: str = "auto") -> int:
    """Bytes of the model weights in `dtype` ("auto": the config's torch_dtype)."""
    return estimate_num_params(config) * DTYPE_BYTES[resolve_dtype(dtype, text_config(config))]


def estimate_activation_peak_bytes(
    config: dict[str, Any],
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    dtype: str = "auto",
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> int:
    """A simple upper estimate of the forward pass's peak activation memory.

    Per batched token, in `dtype`: four hidden-sized buffers (residual, normed input, attention
    output, MLP output), the q/k/v projections, and the MLP's gate, up and activated
    intermediate. Plus float32 logits and sampler probabilities (two vocab-sized rows) for
    each sequence sampled in the step, at most min(max_num_seqs, max_num_batched_tokens).
    """
    config = text_config(config)
    for name, value in (("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_seqs", max_num_seqs)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    hidden = config_int(config, "hidden_size")
    vocab = config_int(config, "vocab_size")
    num_heads = config_int(config, "num_attention_heads")
    num_kv_heads = config_int(config, "num_key_value_heads", default=num_heads)
    head_dim = config_int(config, "head_dim", default=hidden // num_heads)
    intermediate = config_int(config, "intermediate_size")
    if config.get("moe_intermediate_size") is not None:  # MoE: the wider of dense and expert MLP
        intermediate = max(intermediate, config_int(config, "moe_intermediate_size"))
    per_token = 4 * hidden + (num_heads + 2 * num_kv_heads) * head_dim + 3 * intermediate
    element = DTYPE_BYTES[resolve_dtype(dtype, config)]
    sampled_rows = min(max_num_seqs, max_num_batched_tokens)
    return max_num_batched_tokens * per_token * element + 2 * sampled_rows * vocab * 4


def default_max_model_len(config: dict[str, Any]) -> int:
    """The config's `max_position_embeddings` (ValueError naming the key when missing)."""
    return config_int(text_config(config), "max_position_embeddings")


__all__ = [
    "KVCachePlan",
    "default_max_model_len",
    "estimate_activation_peak_bytes",
    "estimate_num_params",
    "estimate_weights_bytes",
    "plan_num_blocks",
]
