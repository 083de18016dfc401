"""`system_fingerprint`: which build and configuration answered, as vLLM's `--fingerprint-mode
hash` writes it: `pagedkv-<version>-<first 8 hex digits of a sha256 of the configuration>`.

The digest covers what changes the answers for the same request (model path, tokenizer, dtype,
KV cache dtype, block size, max_model_len, seed), so a client can tell two deployments apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagedkv import __version__

_FIELDS = ("model", "tokenizer", "dtype", "kv_cache_dtype", "block_size", "seed")


def system_fingerprint(engine: Any) -> str:
    """The fingerprint of `engine` (an `LLMEngine`: reads `engine.args` and `max_model_len`)."""
    args = getattr(engine, "args", None)
    config = {name: getattr(args, name, None) for name in _FIELDS}
    config["max_model_len"] = getattr(engine, "max_model_len", None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    return f"pagedkv-{__version__}-{digest[:8]}"
