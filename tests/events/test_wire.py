"""The KV-event wire format round-trips and keeps vLLM's field and tag names."""

import msgspec
import pytest

from pagedkv.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)


def test_batch_round_trips_with_vllm_names():
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=None,
                    token_ids=list(range(8)), block_size=4),
        BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU"),
        AllBlocksCleared(),
    ])
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgspec.msgpack.decode(payload)
    assert [e["type"] for e in raw["events"]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert set(raw["events"][0]) >= {"block_hashes", "parent_block_hash", "token_ids", "block_size"}
    assert raw["events"][1]["medium"] == "CPU"


def test_malformed_payload_is_a_value_error():
    with pytest.raises(ValueError):
        decode_batch(b"\xc1not msgpack")


def test_seq_frames():
    assert decode_seq(encode_seq(7)) == 7
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(ValueError, match="8 bytes"):
        decode_seq(b"\x00")
