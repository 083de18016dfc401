"""The one dtype table: names, aliases and bytes per element, torch-free.

Everything that sizes memory (the KV spec, the planner's weight estimate) and everything that
allocates it (the model runner, which maps a canonical name to a torch dtype) goes through
`canonical_dtype` / `resolve_dtype`, so a given config and `--dtype` give one dtype everywhere.
"""

from __future__ import annotations

from typing import Any

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}

# The dtypes the model computes in (fp8 is a KV-cache-only storage dtype), and every spelling
# `--dtype` accepts for them.
MODEL_DTYPES = ("float32", "bfloat16", "float16")
MODEL_DTYPE_CHOICES = ("auto", *MODEL_DTYPES,
                       *(alias for alias, name in _DTYPE_ALIASES.items() if name in MODEL_DTYPES))

# The KV cache's storage dtype (vLLM's `kv_cache_dtype`): "auto" is the model's dtype; the fp8
# names store K/V as 8-bit floats with per-tensor scales (pagedkv/model/kv_quant.py). "fp8" is
# e4m3, as in vLLM. Values name torch dtypes (`getattr(torch, name)`), keeping this file torch-free.
FP8_TORCH_DTYPE_NAMES: dict[str, str] = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
# "int8": symmetric int8 with one float32 scale per token, KV head and layer for K and for V,
# computed when the token is written (no calibration; pagedkv/model/kv_int8.py). The scales
# live beside the block and count in its bytes (`KV_SCALE_BYTES`, the KV spec's page size).
# A model dtype name ("bfloat16", ...) stores K/V rounded to that dtype (as vLLM's
# kv_cache_dtype="bfloat16"): the yardstick of the KV-quality benchmark for float32 models.
INT8_KV_DTYPE = "int8"
KV_SCALE_BYTES: dict[str, int] = {INT8_KV_DTYPE: 4}
KV_CACHE_DTYPE_CHOICES = ("auto", *FP8_TORCH_DTYPE_NAMES, INT8_KV_DTYPE, *MODEL_DTYPES)

# "auto" with a config that names no dtype: float32, as transformers loads such a checkpoint
# (and an upper bound when planning memory: never an under-estimate).
DEFAULT_DTYPE = "float32"


def canonical_dtype(dtype: str) -> str:
    """Return the canonical name of a dtype ("bf16" -> "bfloat16", "half" -> "float16").

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


def config_dtype(config: dict[str, Any]) -> str:
    """The canonical dtype a config names (`torch_dtype`, or `dtype` in newer configs), and
    DEFAULT_DTYPE when it names none. Raises ValueError for a dtype we do not know."""
    configured = config.get("torch_dtype") or config.get("dtype")
    if configured is None:
        return DEFAULT_DTYPE
    try:
        return canonical_dtype(configured)
    except ValueError:
        raise ValueError(f"config key 'torch_dtype' has an unsupported dtype {configured!r}") from None


def resolve_dtype(dtype: str, config: dict[str, Any] | None = None) -> str:
    """Resolve `dtype` to a canonical name; "auto" takes the config's dtype (`config_dtype`)."""
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        return config_dtype(config or {})
    return canonical_dtype(dtype)


def resolve_kv_cache_dtype(cache_dtype: str, model_dtype: str) -> str:
    """The canonical dtype of the KV cache: `model_dtype` (canonicalised) for "auto", else the
    named cache dtype itself. Raises ValueError naming `cache_dtype` when it is not one of
    KV_CACHE_DTYPE_CHOICES."""
    if cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, "
                         f"got {cache_dtype!r}")
    return canonical_dtype(model_dtype) if cache_dtype == "auto" else cache_dtype


def is_fp8_dtype(dtype: str) -> bool:
    """Whether the canonical dtype name `dtype` is one of the fp8 KV cache dtypes."""
    return dtype in FP8_TORCH_DTYPE_NAMES


def kv_scale_bytes(dtype: str) -> int:
    """Bytes of scale stored per token, KV head, layer and K or V for a KV cache of canonical
    dtype `dtype`: 4 (a float32) for int8, 0 for every format without per-token scales."""
    return KV_SCALE_BYTES.get(dtype, 0)


def is_int8_dtype(dtype: str) -> bool:
    """Whether the canonical dtype name `dtype` is the int8 (per-token-head scales) KV cache."""
    return dtype == INT8_KV_DTYPE
