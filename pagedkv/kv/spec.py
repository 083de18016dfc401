"""KV cache specs: how many bytes one token and one block of KV cache take.

A spec describes the KV cache of the whole model (all layers together): `bytes_per_token` is
what one token costs across every layer, and `page_size_bytes` (one block) is
`block_size * bytes_per_token`, i.e.
`block_size * num_layers * 2 * num_kv_heads * (head_size * dtype_bytes + scale_bytes)`, where
`scale_bytes` is 4 for the int8 cache's per-token-head float32 scales and 0 otherwise.

Three kinds, built from a Hugging Face `config.json` by `kv_cache_spec_from_hf_config`
(hf_spec.py; with layers of mixed kinds, hybrid_spec.py's grouped spec):

- `FullAttentionSpec`: a key and a value vector per KV head, per layer, per token.
- `SlidingWindowSpec`: the same bytes, but a sequence only keeps its last `sliding_window`
  tokens resident, so it never needs more than `cdiv(window, block_size) + 1` blocks.
- `MLAAttentionSpec` (DeepSeek-V2/V3 multi-head latent attention): one compressed latent of
  `kv_lora_rank + qk_rope_head_dim` values per token per layer, no separate K and V.

Pure Python, no torch: dtypes are names ("bfloat16", "fp8", ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from pagedkv.config.dtypes import (
    DTYPE_BYTES,
    canonical_dtype,
    kv_scale_bytes,
)
from pagedkv.utils import cdiv


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class KVCacheSpec:
    """Base of every spec. Subclasses are frozen dataclasses with at least `block_size`
    (tokens per block), `dtype` (a name) and `num_layers`, and define `bytes_per_token`."""

    block_size: int
    dtype: str
    num_layers: int
    kind = "base"

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size)
        check_positive_int("num_layers", self.num_layers)
        # frozen: normalise the dtype name through object.__setattr__
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (block_size tokens) across all layers."""
        return self.block_size * self.bytes_per_token

    def max_blocks_per_seq(self, max_model_len: int) -> int:
        """Most blocks one sequence of `max_model_len` tokens holds at once."""
        check_positive_int("max_model_len", max_model_len)
        return cdiv(max_model_len, self.block_size)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the spec's fields plus kind, bytes_per_token and page_size_bytes."""
        out: dict[str, Any] = {"kind": self.kind, **asdict(self)}
        out["bytes_per_token"] = self.bytes_per_token
        out["page_size_bytes"] = self.page_size_bytes
        return out


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Full attention: K and V of `num_kv_heads * head_size` values per layer per token."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    num_layers: int
    sliding_window: int | None = None

    kind = "full_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("num_kv_heads", self.num_kv_heads)
        check_positive_int("head_size", self.head_size)
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)

    @property
    def bytes_per_token(self) -> int:
        """K and V of every KV head and layer, plus their per-token scales (int8 caches: one
        float32 per K or V vector, stored beside the block)."""
        per_vector = self.head_size * self.dtype_bytes + kv_scale_bytes(self.dtype)
        return self.num_layers * 2 * self.num_kv_heads * per_vector


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Sliding-window attention: same bytes per token, but only the last `sliding_window`
    tokens stay resident, so at most `cdiv(window, block_size) + 1` blocks per sequence
    (the +1 covers a window that straddles block boundaries)."""

    sliding_window: int = 0

    kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("sliding_window", self.sliding_window)

    def max_blocks_per_seq(self, max_model_len: int) -> int:
        full = super().max_blocks_per_seq(max_model_len)
        return min(full, cdiv(self.sliding_window, self.block_size) + 1)


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention: one latent of `kv_lora_rank + qk_rope_head_dim` values per
    layer per token (shared by all heads, no separate K and V, hence no factor 2)."""

    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str
    num_layers: int

    kind = "mla"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int("kv_lora_rank", self.kv_lora_rank)
        check_positive_int("qk_rope_head_dim", self.qk_rope_head_dim)

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * (self.head_size * self.dtype_bytes + kv_scale_bytes(self.dtype))


def bundled_config_names() -> list[str]:
    """Names of the example configs shipped in pagedkv/data/configs ("llama-3-8b", ...)."""
    folder = resources.files("pagedkv").joinpath("data", "configs")
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def bundled_config_path(name: str) -> str:
    """Path of a bundled example config.json by name ("llama-3-8b"); ValueError if unknown."""
    names = bundled_config_names()
    if name not in names:
        raise ValueError(f"no bundled config named {name!r}; bundled: {names}")
    return str(resources.files("pagedkv").joinpath("data", "configs", f"{name}.json"))
