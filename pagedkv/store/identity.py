"""The model part of every store key: two models (or dtypes, layouts, block sizes) never share.

`model_identity` is a 16-byte digest of: the model's config.json, a fingerprint of each weight
file (name, size, and sha256 of its first and last MiB: two checkpoints of the same
architecture differ there without reading gigabytes), the KV dtype, the cache layout and the
block size. Block keys are `identity + chained block hash`; the chained hash already carries
`cache_salt` and the LoRA name, so tenant isolation holds in every tier.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_EDGE = 1 << 20
IDENTITY_SIZE = 16


def _file_fingerprint(path: Path) -> bytes:
    size = path.stat().st_size
    digest = hashlib.sha256(path.name.encode() + size.to_bytes(8, "little"))
    with path.open("rb") as f:
        digest.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(_EDGE, size - _EDGE))
            digest.update(f.read(_EDGE))
    return digest.digest()


def model_identity(model_dir: str | Path, weight_files: list[Path], dtype: str, layout: str,
                   block_size: int) -> bytes:
    """16 bytes naming (model, dtype, layout, block size); the same in every process."""
    digest = hashlib.sha256(b"pagedkv/kv-store/v1\0")
    digest.update((Path(model_dir) / "config.json").read_bytes())
    for path in weight_files:
        digest.update(_file_fingerprint(path))
    digest.update(f"\0{dtype}\0{layout}\0{block_size}".encode())
    return digest.digest()[:IDENTITY_SIZE]


def block_key(identity: bytes, block_hash: bytes) -> bytes:
    """The store key of one block."""
    return identity + block_hash
