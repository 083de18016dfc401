"""The one reader of a Hugging Face model's config.json, torch-free.

`HFModelConfig.from_dict` turns config.json into the facts both halves of the engine need (layers,
heads, head size, each layer's sliding window, dtype); `kv.spec` builds the KV cache spec from it
and `model.config` the model's shapes, so the KV manager and the model can never disagree.
`dtypes` is the one dtype table; `defaults` the engine defaults shared by the planner and the engine.
"""

from pagedkv.config.defaults import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from pagedkv.config.dtypes import (
    DEFAULT_DTYPE,
    DTYPE_BYTES,
    MODEL_DTYPE_CHOICES,
    MODEL_DTYPES,
    canonical_dtype,
    dtype_bytes,
    resolve_dtype,
)
from pagedkv.config.hf_config import HFModelConfig, config_int, read_config_json, text_config

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_MAX_NUM_SEQS",
    "DTYPE_BYTES",
    "MODEL_DTYPES",
    "MODEL_DTYPE_CHOICES",
    "HFModelConfig",
    "canonical_dtype",
    "config_int",
    "dtype_bytes",
    "read_config_json",
    "resolve_dtype",
    "text_config",
]
