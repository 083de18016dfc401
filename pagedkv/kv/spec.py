"""KV cache specs: how many bytes one token and one block of KV cache take (seed 000 section 2).

A spec describes the KV cache of the whole model (all layers together): `bytes_per_token` is
what one token costs across every layer, and `page_size_bytes` (one block) is
`block_size * bytes_per_token`, i.e. seed 000's
`block_size * num_layers * 2 * num_kv_heads * head_size * dtype_bytes`.

Three kinds, built from a Hugging Face `config.json` by `kv_cache_spec_from_hf_config`:

- `FullAttentionSpec`: a key and a value vector per KV head, per layer, per token.
- `SlidingWindowSpec`: the same bytes, but a sequence only keeps its last `sliding_window`
  tokens resident, so it never needs more than `cdiv(window, block_size) + 1` blocks.
- `MLAAttentionSpec` (DeepSeek-V2/V3 multi-head latent attention): one compressed latent of
  `kv_lora_rank + qk_rope_head_dim` values per token per layer, no separate K and V.

Pure Python, no torch: dtypes are names ("bfloat16", "fp8", ...).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}

DEFAULT_DTYPE = "bfloat16"

# Model types whose layers interleave sliding-window and full attention. Planning treats them
# as full attention on every layer: an upper bound on memory, never an under-estimate.
_INTERLEAVED_SLIDING_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "cohere2"})


def canonical_dtype(dtype: str) -> str:
    """Return the canonical name of a KV cache dtype ("bf16" -> "bfloat16", "half" -> "float16").

    Accepts a "torch." prefix ("torch.float16"). "auto" is not a dtype here: resolve it first
    with `resolve_dtype`. Raises ValueError for an unknown name.
    """
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string, got {dtype!r}")
    name = dtype.strip().lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        known = sorted(set(DTYPE_BYTES) | set(_DTYPE_ALIASES))
        raise ValueError(f"unknown dtype {dtype!r}; expected 'auto' or one of {known}")
    return name


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype` (any accepted alias)."""
    return DTYPE_BYTES[canonical_dtype(dtype)]


def resolve_dtype(dtype: str, config: dict[str, Any] | None = None) -> str:
    """Resolve `dtype` to a canonical name; "auto" takes the config's `torch_dtype` (or the
    `dtype` key of newer configs), and bfloat16 when the config names neither."""
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        config = config or {}
        configured = config.get("torch_dtype") or config.get("dtype")
        if configured is None:
            return DEFAULT_DTYPE
        try:
            return canonical_dtype(configured)
        except ValueError:
            raise ValueError(
                f"config key 'torch_dtype' has an unsupported dtype {configured!r}"
            ) from None
    return canonical_dtype(dtype)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def _check_positive_int(name: str, value: Any) -> None:
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
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("num_layers", self.num_layers)
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
        _check_positive_int("max_model_len", max_model_len)
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
        _check_positive_int("num_kv_heads", self.num_kv_heads)
        _check_positive_int("head_size", self.head_size)
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Sliding-window attention: same bytes per token, but only the last `sliding_window`
    tokens stay resident, so at most `cdiv(window, block_size) + 1` blocks per sequence
    (the +1 covers a window that straddles block boundaries)."""

    sliding_window: int = 0

    kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("sliding_window", self.sliding_window)

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
        _check_positive_int("kv_lora_rank", self.kv_lora_rank)
        _check_positive_int("qk_rope_head_dim", self.qk_rope_head_dim)

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.head_size * self.dtype_bytes


# ---------------------------------------------------------------- Hugging Face configs


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a JSON object, got {type(config).__name__}")
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in config:
        merged = dict(text)
        for key in ("torch_dtype", "dtype"):
            if key not in merged and key in config:
                merged[key] = config[key]
        return merged
    return config


def config_int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """Read a positive int from `config[key]`; missing (or null) uses `default` when given.

    Raises ValueError naming the key when it is missing without default, not an int, or <= 0.
    """
    value = config.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"config is missing required key {key!r}")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _sliding_window(config: dict[str, Any], num_layers: int) -> int | None:
    """The window when every layer slides; None for full attention (or a mix of both)."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None
    window = config_int(config, "sliding_window")
    if config.get("model_type") in _INTERLEAVED_SLIDING_MODEL_TYPES:
        return None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        return window if all(t == "sliding_attention" for t in layer_types) else None
    if config.get("use_sliding_window") is True and config.get("max_window_layers") is not None:
        # Qwen2: layers with index >= max_window_layers slide, the ones below attend fully.
        max_window_layers = config.get("max_window_layers")
        if not isinstance(max_window_layers, int) or max_window_layers < 0:
            raise ValueError(
                f"config key 'max_window_layers' must be a non-negative integer, "
                f"got {max_window_layers!r}"
            )
        return window if max_window_layers == 0 else None
    return window


def kv_cache_spec_from_hf_config(
    config: dict[str, Any], block_size: int = 16, dtype: str = "auto"
) -> KVCacheSpec:
    """Build the KV cache spec of a Hugging Face `config.json` (already parsed into a dict).

    Llama / Mistral / Qwen2 / Qwen3 / Gemma: `num_key_value_heads` (default
    `num_attention_heads`), `head_dim` (default `hidden_size // num_attention_heads`),
    `num_hidden_layers`; a `sliding_window` gives a SlidingWindowSpec unless
    `use_sliding_window` is false or only some layers slide (then full attention, an upper
    bound). DeepSeek-V2/V3 (`kv_lora_rank` set): MLAAttentionSpec. `dtype="auto"` takes the
    config's `torch_dtype`. Raises ValueError naming the missing or invalid key.
    """
    _check_positive_int("block_size", block_size)
    config = text_config(config)
    kv_dtype = resolve_dtype(dtype, config)
    num_layers = config_int(config, "num_hidden_layers")

    if config.get("kv_lora_rank") is not None:
        return MLAAttentionSpec(
            block_size=block_size,
            kv_lora_rank=config_int(config, "kv_lora_rank"),
            qk_rope_head_dim=config_int(config, "qk_rope_head_dim"),
            dtype=kv_dtype,
            num_layers=num_layers,
        )

    num_heads = config_int(config, "num_attention_heads")
    num_kv_heads = config_int(config, "num_key_value_heads", default=num_heads)
    if config.get("head_dim") is not None:
        head_size = config_int(config, "head_dim")
    else:
        hidden_size = config_int(config, "hidden_size")
        if hidden_size % num_heads:
            raise ValueError(
                f"config key 'hidden_size' ({hidden_size}) is not divisible by "
                f"'num_attention_heads' ({num_heads}) and no 'head_dim' is given"
            )
        head_size = hidden_size // num_heads
    window = _sliding_window(config, num_layers)
    if window is not None:
        return SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=kv_dtype,
            num_layers=num_layers,
            sliding_window=window,
        )
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=kv_dtype,
        num_layers=num_layers,
    )


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


def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a Hugging Face config: `path` is a config.json file or a model directory holding one.

    Raises FileNotFoundError when there is no such file, ValueError when it is not a JSON object.
    """
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        if os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} has no config.json")
        raise FileNotFoundError(f"config file {path!r} does not exist")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {file!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"config file {file!r} must hold a JSON object, got {type(config).__name__}")
    return config
