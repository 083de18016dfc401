"""How many KV blocks a tier of a given size holds (the tiers and `pagedkv plan` share this)."""

from __future__ import annotations

from pagedkv.store.codec import HEADER_SIZE
from pagedkv.store.identity import IDENTITY_SIZE

MAX_BLOCK_HASH_SIZE = 32  # sha256; xxh3-128 keys are 16 bytes shorter
STORED_OVERHEAD = HEADER_SIZE + IDENTITY_SIZE + MAX_BLOCK_HASH_SIZE  # header + key per value


def host_tier_blocks(capacity_bytes: int, block_bytes: int) -> int:
    """Blocks a host tier of `capacity_bytes` holds (payloads only)."""
    return capacity_bytes // block_bytes


def disk_tier_blocks(capacity_bytes: int, block_bytes: int,
                     hash_size: int = MAX_BLOCK_HASH_SIZE) -> int:
    """Blocks a disk tier of `capacity_bytes` holds (each file: header, key of a `hash_size`
    bytes block hash, payload)."""
    return capacity_bytes // (block_bytes + HEADER_SIZE + IDENTITY_SIZE + hash_size)
