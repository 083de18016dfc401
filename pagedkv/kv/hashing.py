"""Deterministic chained hashes of full KV blocks (the prefix-cache keys).

The hash of block i is H(parent hash, the block's token ids, extra keys), where the parent of
block 0 is `NONE_HASH`, a constant derived from a fixed string. Inputs are serialized to bytes
deterministically (little-endian int64 tokens, length prefixes, every extra key tagged with its
kind and its value's type), so a hash is the same in every process, on every restart and under
any PYTHONHASHSEED: instances, routers and offload tiers can share them. Python's `hash()` is
never used.

Extra keys are `(kind, value)` pairs. A request contributes `("salt", cache_salt)` to its first
block only (changing that block's hash changes every chained hash after it) and
`("lora", lora_name)` to every block. Because the kind is part of the serialized key, a salt can
never collide with a LoRA name of the same spelling.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

import xxhash

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_HASH_FNS: dict[str, HashFn] = {
    "sha256": _sha256,
    "xxhash": xxhash.xxh3_128_digest,
}


def get_hash_fn(name: str) -> HashFn:
    """The bytes -> digest function for `name`: "sha256" (32 bytes) or "xxhash" (xxh3_128, 16)."""
    try:
        return _HASH_FNS[name]
    except KeyError:
        raise ValueError(f"unknown hash algorithm {name!r}; choose one of "
                         f"{sorted(_HASH_FNS)}") from None


# Parent of every request's first block. A fixed string hashed with sha256: the same everywhere.
NONE_HASH: BlockHash = hashlib.sha256(b"pagedkv/NONE_HASH/v1").digest()


def _encode_value(value: object) -> bytes:
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"s" + _U32.pack(len(raw)) + raw
    if isinstance(value, bool):
        raise ValueError(f"unsupported extra key value {value!r} (bool)")
    if isinstance(value, int):
        return b"i" + _I64.pack(value)
    if isinstance(value, bytes):
        return b"b" + _U32.pack(len(value)) + value
    raise ValueError(f"unsupported extra key value {value!r} of type {type(value).__name__}")


def encode_extra_keys(extra_keys: tuple | None) -> bytes:
    """Serialize `(kind, value)` pairs: a count, then each kind and value, length-prefixed."""
    if not extra_keys:
        return _U32.pack(0)
    parts = [_U32.pack(len(extra_keys))]
    for key in extra_keys:
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)):
            raise ValueError(f"extra key {key!r} must be a (kind: str, value) pair")
        kind = key[0].encode("utf-8")
        parts.append(_U32.pack(len(kind)) + kind + _encode_value(key[1]))
    return b"".join(parts)


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    n = len(token_ids)
    try:
        return struct.pack(f"<I{n}q", n, *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be int64 integers: {e}") from None


def hash_block_tokens(hash_fn: HashFn, parent_hash: BlockHash | None,
                      token_ids: Sequence[int], extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block chained to `parent_hash` (None means the first block)."""
    if parent_hash is None:
        parent_hash = NONE_HASH
    return hash_fn(parent_hash + _encode_tokens(token_ids) + encode_extra_keys(extra_keys))


def request_extra_keys(cache_salt: str | None, lora_name: str | None,
                       first_block: bool) -> tuple | None:
    """The extra keys of a request's block: salt in the first block only, LoRA in every block.
    An empty salt is no salt, as in vLLM (`generate_block_hash_extra_keys` tests the salt's
    truth): the same hashes, and `None` in the events' `extra_keys`."""
    keys: list[tuple[str, object]] = []
    if first_block and cache_salt:
        keys.append(("salt", cache_salt))
    if lora_name is not None:
        keys.append(("lora", lora_name))
    return tuple(keys) if keys else None


def event_extra_keys(cache_salt: str | None, lora_name: str | None,
                     first_block: bool) -> tuple | None:
    """A block's extra keys as vLLM 0.32 publishes them in `BlockStored.extra_keys`: untagged
    (`to_event_extra_keys`), the LoRA name before the cache salt. The same keys as
    `request_extra_keys`, which our hashes use."""
    keys = dict(request_extra_keys(cache_salt, lora_name, first_block) or ())
    return tuple(keys[kind] for kind in ("lora", "salt") if kind in keys) or None


class HashableRequest(Protocol):
    all_token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None


class RequestBlockHasher:
    """Appends the hashes of a request's newly full blocks to its hash list.

    `hasher(request, block_hashes)` hashes blocks len(block_hashes) .. num_tokens // block_size - 1
    and appends them in place, so every block is hashed once as the request's tokens grow. The
    result equals chaining `hash_block_tokens` with `request_extra_keys` (tested).
    """

    __slots__ = ("hash_fn", "block_size", "_len_prefix")

    def __init__(self, hash_fn: HashFn | str, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.hash_fn = get_hash_fn(hash_fn) if isinstance(hash_fn, str) else hash_fn
        self.block_size = block_size
        self._len_prefix = _U32.pack(block_size)

    def __call__(self, request: HashableRequest, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """Mutates and returns `block_hashes`."""
        bs = self.block_size
        tokens = request.all_token_ids
        start = len(block_hashes)
        end = len(tokens) // bs
        if start >= end:
            return block_hashes
        hash_fn = self.hash_fn
        lora = request.lora_name
        rest = encode_extra_keys(request_extra_keys(None, lora, False))
        if start == 0:
            first = encode_extra_keys(request_extra_keys(request.cache_salt, lora, True))
            parent = NONE_HASH
        else:
            first = rest
            parent = block_hashes[-1]
        # Serialize all new blocks' tokens at once, then hash block by block.
        data = _encode_tokens(tokens[start * bs:end * bs])[4:]
        prefix = self._len_prefix
        nbytes = 8 * bs
        append = block_hashes.append
        for j, i in enumerate(range(start, end)):
            parent = hash_fn(parent + prefix + data[j * nbytes:(j + 1) * nbytes]
                             + (first if i == 0 else rest))
            append(parent)
        return block_hashes


# Hybrid KV cache groups (kv/coordinator.py) cache their blocks under the request's block hash
# plus this mark and the group index, so one pool holds every group's copy of a block; group 0
# uses the plain hash (a single-group cache is unchanged). `split_group_key` undoes it.
GROUP_KEY_MARK = b"\xffpagedkv-grp"


def group_key_suffix(group_idx: int) -> bytes:
    """The bytes appended to a block hash to key group `group_idx`'s block (b"" for group 0)."""
    if not isinstance(group_idx, int) or not 0 <= group_idx < 256:
        raise ValueError(f"group_idx must be an int in [0, 256), got {group_idx!r}")
    return b"" if group_idx == 0 else GROUP_KEY_MARK + bytes([group_idx])


def split_group_key(key: BlockHash) -> tuple[BlockHash, int]:
    """(the request's block hash, group index) of a pool key."""
    n = len(GROUP_KEY_MARK) + 1
    if len(key) > n and key[-n:-1] == GROUP_KEY_MARK:
        return key[:-n], key[-1]
    return key, 0
