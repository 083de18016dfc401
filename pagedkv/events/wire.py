"""The wire format of KV-cache events: vLLM's `KVEventBatch`, msgpack-encoded with msgspec.

An instance publishes one batch per engine step over a ZMQ PUB socket as three frames:
`(topic, seq, payload)`, where `seq` is an 8-byte big-endian sequence number (a subscriber that
sees a gap knows it missed batches) and `payload` is `encode_batch(batch)`. The structs keep
vLLM's class and field names (tagged by class name, defaults omitted), so a router written for
vLLM's events can index a pagedkv instance and ours can index vLLM's.

Block hashes are the engine's chained prefix hashes (`pagedkv.kv.hashing`), as raw bytes.
`medium` says which tier holds the blocks: "GPU" for the device pool (vLLM's name, used on CPU
too), "CPU", "DISK" or "REDIS" for the offload tiers.
"""

from __future__ import annotations

import msgspec

ExternalBlockHash = bytes | int

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REDIS = "REDIS"


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three event kinds; encoded with a `type` field naming the class."""


class BlockStored(KVCacheEvent):
    """A chain of full blocks now cached under `block_hashes`, hanging off `parent_block_hash`
    (None for a chain that starts a prompt). `token_ids` are all their tokens, in order."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_DEVICE
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held by `medium` (evicted)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = MEDIUM_DEVICE


class AllBlocksCleared(KVCacheEvent):
    """Every block of the instance's prefix cache was dropped."""


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The events of one engine step, in order. `ts` is the publisher's wall clock (seconds)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload frame of one batch."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload frame; raises `msgspec.DecodeError` (a ValueError) on a malformed one."""
    return _DECODER.decode(payload)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian sequence-number frame."""
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number of a `encode_seq` frame; -1 marks the end of a replay."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
