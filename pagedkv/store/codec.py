"""The stored value of one KV block: a fixed header, the full key, then the payload bytes.

Header (little-endian): magic `PKVB`, format version (u16), key length (u16), payload length
(u64), xxh3-64 of key + payload (u64). `decode_block` returns the payload only when the magic,
version, key, length and checksum all match, so a truncated, corrupt or misfiled value is a
miss, never wrong KV. Used by the disk and Redis tiers (host memory holds payloads as they are).
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"PKVB"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQ")
HEADER_SIZE = _HEADER.size


class CorruptBlockError(ValueError):
    """A stored value that does not decode to the expected block."""


def block_checksum(key: bytes, payload: bytes | memoryview) -> int:
    """xxh3-64 of key + payload, streamed (no concatenated copy of the payload)."""
    digest = xxhash.xxh3_64(key)
    digest.update(payload)
    return digest.intdigest()


def encode_block(key: bytes, payload: bytes | memoryview) -> bytes:
    """Header + key + payload, ready to be written in one piece."""
    checksum = block_checksum(key, payload)
    return _HEADER.pack(MAGIC, VERSION, len(key), len(payload), checksum) + key + payload


def decode_block(key: bytes, value: bytes | memoryview) -> bytes:
    """The payload of `value`, stored under `key`. Raises CorruptBlockError on any mismatch."""
    if len(value) < HEADER_SIZE:
        raise CorruptBlockError(f"value of {len(value)} bytes is shorter than the header")
    magic, version, key_len, payload_len, checksum = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlockError(f"bad magic/version {magic!r}/{version}")
    if len(value) != HEADER_SIZE + key_len + payload_len:
        raise CorruptBlockError(f"value has {len(value)} bytes, header says "
                                f"{HEADER_SIZE + key_len + payload_len}")
    stored_key = bytes(value[HEADER_SIZE:HEADER_SIZE + key_len])
    if stored_key != key:
        raise CorruptBlockError("value was stored under another key")
    payload = bytes(value[HEADER_SIZE + key_len:])
    if block_checksum(stored_key, payload) != checksum:
        raise CorruptBlockError("checksum mismatch")
    return payload
