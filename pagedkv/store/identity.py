"""The model part of every store key: two models (or dtypes, layouts, block sizes) never share.

`model_identity` is a 16-byte digest of: the model's config.json (a GGUF model's lies in its
weight file), each weight file's name and full-content digest (every byte: see weight_digest.py,
cached by path and stat so a restart does not re-read the weights), the KV dtype, the cache
layout and the block size. Two checkpoints that differ in any byte of any weight file never
share a block, in any tier (host, disk and Redis all use this key). Block keys are `identity + chained block hash`; the chained hash already carries
`cache_salt` and the LoRA name, so tenant isolation holds in every tier.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pagedkv.store.weight_digest import weight_file_digests

IDENTITY_SIZE = 16


def model_identity(model_dir: str | Path, weight_files: list[Path], dtype: str, layout: str,
                   block_size: int, digest_cache_dir: Path | None = None) -> bytes:
    """16 bytes naming (model, dtype, layout, block size); the same in every process.
    `digest_cache_dir`: where weight digests are cached (default: the user cache dir)."""
    digest = hashlib.sha256(b"pagedkv/kv-store/v2\0")
    config = Path(model_dir) / "config.json"
    if config.is_file():  # a GGUF model has none: its one weight file holds the config
        digest.update(config.read_bytes())
    contents = weight_file_digests(weight_files, digest_cache_dir)
    for path, content in zip(weight_files, contents, strict=True):
        digest.update(f"\0{Path(path).name}\0{content}".encode())
    digest.update(f"\0{dtype}\0{layout}\0{block_size}".encode())
    return digest.digest()[:IDENTITY_SIZE]


def block_key(identity: bytes, block_hash: bytes) -> bytes:
    """The store key of one block."""
    return identity + block_hash
