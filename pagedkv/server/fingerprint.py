"""`system_fingerprint`: which build and configuration answered, as vLLM's `--fingerprint-mode
hash` writes it: `pagedkv-<version>-<first 8 hex digits of a sha256 of the configuration>`.

The digest covers what changes the answers for the same request (model path, tokenizer, dtype,
KV cache dtype, block size, max_model_len, seed), so a client can tell two deployments apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from pagedkv import __version__

if TYPE_CHECKING:
    from pagedkv.server.engine_facts import EngineFacts

_FIELDS = ("model", "tokenizer", "dtype", "kv_cache_dtype", "block_size", "seed")


def system_fingerprint(facts: EngineFacts) -> str:
    """The fingerprint of an engine (its `EngineArgs` fields above and its max_model_len)."""
    config = {name: getattr(facts.args, name) for name in _FIELDS}
    config["max_model_len"] = facts.ready.max_model_len
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    return f"pagedkv-{__version__}-{digest[:8]}"
