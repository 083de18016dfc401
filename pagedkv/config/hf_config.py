"""HFModelConfig: the facts of a Hugging Face config.json that the KV cache and the model share.

One reader, torch-free, so the KV manager and the model can never disagree about them:
layers, attention heads, head size, each layer's sliding window and the dtype. The window rules
follow transformers' config classes:

- `layer_types` ("sliding_attention" / "full_attention" per layer), when given, decides;
- Qwen2 / Qwen3 (and their MoE variants): `sliding_window` counts only with
  `use_sliding_window: true` (default false), and then only layers >= `max_window_layers`
  (default 28) slide;
- Gemma2 alternates sliding and full layers; Gemma3 and Cohere2 slide every layer but each
  `sliding_window_pattern`-th (defaults 6 and 4);
- otherwise (Mistral, ...) a `sliding_window` applies to every layer.

Multimodal configs nest the language model under `text_config`; `text_config()` unwraps it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pagedkv.config.dtypes import config_dtype

# Qwen families whose `sliding_window` is switched by `use_sliding_window`, and
# transformers' default max_window_layers for them.
_QWEN_MODEL_TYPES = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})
_QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
# model_type -> default sliding_window_pattern (every pattern-th layer attends fully).
_PATTERN_MODEL_TYPES = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal configs nest it under text_config)."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a JSON object, got {type(config).__name__}")
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in config:
        merged = dict(text)
        for key in ("torch_dtype", "dtype", "architectures"):
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


def _non_negative_int(config: dict[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config key {key!r} must be a non-negative integer, got {value!r}")
    return value


def model_type_of(config: dict[str, Any]) -> str:
    """`model_type`, or else derived from the first architecture ("Qwen2ForCausalLM" -> "qwen2")."""
    model_type = config.get("model_type")
    if model_type:
        return str(model_type)
    architectures = config.get("architectures") or [""]
    return str(architectures[0]).removesuffix("ForCausalLM").lower()


def layer_sliding_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), by the rules in the module docstring."""
    model_type = model_type_of(config)
    if config.get("sliding_window") is None:
        return (None,) * num_layers
    if model_type in _QWEN_MODEL_TYPES and not config.get("use_sliding_window", False):
        return (None,) * num_layers
    if config.get("use_sliding_window") is False:
        return (None,) * num_layers
    window = config_int(config, "sliding_window")
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ValueError(f"config key 'layer_types' must list one type per layer "
                             f"({num_layers}), got {layer_types!r}")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if model_type in _QWEN_MODEL_TYPES:
        first = _non_negative_int(config, "max_window_layers", _QWEN_DEFAULT_MAX_WINDOW_LAYERS)
        return tuple(window if i >= first else None for i in range(num_layers))
    if model_type in _PATTERN_MODEL_TYPES:
        pattern = config_int(config, "sliding_window_pattern", _PATTERN_MODEL_TYPES[model_type])
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    return (window,) * num_layers


@dataclass(frozen=True)
class HFModelConfig:
    """What config.json says about the attention layers, parsed once.

    `layer_sliding_windows[i]` is layer i's window W (a token at position p sees positions
    p - W + 1 .. p) or None for full attention. `dtype` is the canonical name of the config's
    dtype (`DEFAULT_DTYPE` when it names none). `kv_lora_rank` / `qk_rope_head_dim` are set only
    for multi-head latent attention (DeepSeek-V2/V3). `raw` is the (text) config dict itself,
    for the model-specific keys a model's config adapter reads.
    """

    architectures: tuple[str, ...]
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_sliding_windows: tuple[int | None, ...]
    dtype: str
    max_position_embeddings: int | None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer slides with the same one; None otherwise (full attention
        on some layer, or mixed windows: the KV cache then keeps full-attention blocks)."""
        windows = set(self.layer_sliding_windows)
        if len(windows) == 1:
            return next(iter(windows))
        return None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> HFModelConfig:
        """Parse a config.json dict (multimodal ones through `text_config`). Raises ValueError
        naming the missing or invalid key."""
        config = text_config(config)
        num_layers = config_int(config, "num_hidden_layers")
        num_heads = config_int(config, "num_attention_heads")
        num_kv_heads = config_int(config, "num_key_value_heads", default=num_heads)
        if config.get("head_dim") is not None:
            head_dim = config_int(config, "head_dim")
        else:
            hidden_size = config_int(config, "hidden_size")
            if hidden_size % num_heads:
                raise ValueError(f"config key 'hidden_size' ({hidden_size}) is not divisible by "
                                 f"'num_attention_heads' ({num_heads}) and no 'head_dim' is given")
            head_dim = hidden_size // num_heads
        mla = config.get("kv_lora_rank") is not None
        max_len = config.get("max_position_embeddings")
        architectures = config.get("architectures") or ()
        return cls(
            architectures=tuple(architectures) if isinstance(architectures, list) else (),
            model_type=model_type_of(config),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            layer_sliding_windows=layer_sliding_windows(config, num_layers),
            dtype=config_dtype(config),
            max_position_embeddings=None if max_len is None
            else config_int(config, "max_position_embeddings"),
            kv_lora_rank=config_int(config, "kv_lora_rank") if mla else None,
            qk_rope_head_dim=config_int(config, "qk_rope_head_dim") if mla else None,
            raw=config,
        )


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a Hugging Face config.json: `path` is the file or a model directory holding one
    (a GGUF model's config: `pagedkv.model.config_files.load_hf_config`).

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
