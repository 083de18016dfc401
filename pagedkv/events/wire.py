"""The wire format of KV-cache events: vLLM 0.32's `KVEventBatch`, msgpack-encoded with msgspec.

An instance publishes one batch per engine step over a ZMQ PUB socket as three frames:
`(topic, seq, payload)`, where `seq` is an 8-byte big-endian sequence number (a subscriber that
sees a gap knows it missed batches, and can ask the replay endpoint for them) and `payload` is
`encode_batch(batch)`. The structs are declared as vLLM 0.32 declares them
(`vllm/distributed/kv_events.py`): the batch is an *array* `[ts, events, data_parallel_rank]`,
each event a map tagged `type` with its class name. vLLM declares `BlockStored.lora_id`,
`medium` and `lora_name` and `BlockRemoved.medium` without defaults (required on the wire); ours
have defaults for convenience but the two event structs are encoded with every field
(`omit_defaults=False`), so vLLM's own decoder reads our batches, and ours reads vLLM's (whose
block hashes may be ints).

Block hashes are the engine's chained prefix hashes (`pagedkv.kv.hashing`), as raw bytes.
`medium` says which tier holds the blocks: "GPU" for the device pool (vLLM's name, used on CPU
too), "CPU", "DISK" or "REDIS" for the offload tiers.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REDIS = "REDIS"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds; encoded with a `type` field naming the class."""


class BlockStored(KVCacheEvent, omit_defaults=False):
    """A chain of full blocks now cached under `block_hashes`, hanging off `parent_block_hash`
    (None for a chain that starts a prompt). `token_ids` are all their tokens, in order.
    The fields after `lora_name` are vLLM's optional metadata: we set `extra_keys`, the group
    (`group_idx`, `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`), the rest decoded only."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_DEVICE
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent, omit_defaults=False):
    """Blocks no longer held by `medium` (evicted)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = MEDIUM_DEVICE
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the instance's prefix cache was dropped."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step, in order. `ts` is the publisher's wall clock (seconds);
    `data_parallel_rank` is set by the publisher (0 for a single engine), as vLLM's does."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def block_stored(block_hashes: list[ExternalBlockHash], parent_block_hash: ExternalBlockHash | None,
                 token_ids: list[int], block_size: int, medium: str = MEDIUM_DEVICE, *,
                 group_idx: int | None = None,
                 extra_keys: list[tuple[Any, ...] | None] | None = None) -> BlockStored:
    """A `BlockStored` without LoRA (the engine serves none), on `medium` (of KV cache group
    `group_idx`, None with one group). `extra_keys`: per block, vLLM's untagged keys
    (`pagedkv.kv.hashing.event_extra_keys`: a request's cache_salt in its first block), so a
    router re-hashing the tokens keeps salted and unsalted prefixes apart."""
    return BlockStored(block_hashes=block_hashes, parent_block_hash=parent_block_hash,
                       token_ids=token_ids, block_size=block_size, lora_id=None, medium=medium,
                       lora_name=None, group_idx=group_idx, extra_keys=extra_keys)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload frame of one batch."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload frame; raises `msgspec.DecodeError` (a ValueError) on a malformed one."""
    return _DECODER.decode(payload)


END_SEQ = -1  # the sequence number of the replay endpoint's end-of-replay message


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian (signed) sequence-number frame."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """The sequence number of a `encode_seq` frame; -1 (`END_SEQ`) marks the end of a replay."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
