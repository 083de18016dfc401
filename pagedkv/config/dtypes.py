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
