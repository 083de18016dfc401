"""The KV-event wire format is vLLM 0.32's: its decoder reads ours, ours reads its payloads.

The `Vllm*` structs (tests/vllm_kv_events.py) are declared exactly as
`vllm/distributed/kv_events.py` (vLLM 0.32) declares them.
"""


import msgspec
import pytest

from pagedkv.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_stored,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from tests.vllm_kv_events import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmKVEventBatch,
)

H = [bytes([i]) * 32 for i in range(3)]


def _our_batch() -> KVEventBatch:
    return KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        block_stored(H[:2], None, list(range(8)), 4),
        block_stored([H[2]], H[1], list(range(8, 12)), 4, medium="CPU"),
        BlockRemoved(block_hashes=[H[0]], medium="CPU"),
        AllBlocksCleared(),
    ])


def test_vllm_decoder_reads_our_batch():
    decoded = msgspec.msgpack.Decoder(VllmKVEventBatch).decode(encode_batch(_our_batch()))
    assert decoded.ts == 1.5 and decoded.data_parallel_rank == 0
    first, second, removed, cleared = decoded.events
    assert first == VllmBlockStored(block_hashes=H[:2], parent_block_hash=None,
                                    token_ids=list(range(8)), block_size=4, lora_id=None,
                                    medium="GPU", lora_name=None)
    assert (second.parent_block_hash, second.medium) == (H[1], "CPU")
    assert removed == VllmBlockRemoved(block_hashes=[H[0]], medium="CPU")
    assert isinstance(cleared, VllmAllBlocksCleared)


def test_payload_is_an_array_with_tagged_maps_and_required_fields():
    raw = msgspec.msgpack.decode(encode_batch(_our_batch()))
    assert isinstance(raw, list) and raw[0] == 1.5 and raw[2] == 0
    assert [e["type"] for e in raw[1]] == ["BlockStored", "BlockStored", "BlockRemoved",
                                           "AllBlocksCleared"]
    assert {"lora_id", "medium", "lora_name"} <= set(raw[1][0])  # required by vLLM's decoder
    assert "medium" in raw[1][2]


def test_we_decode_vllm_shaped_payloads_with_int_hashes_and_extras():
    vllm_batch = VllmKVEventBatch(ts=2.0, data_parallel_rank=1, events=[
        VllmBlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(32)),
                        block_size=16, lora_id=None, medium="GPU", lora_name=None,
                        extra_keys=[None, ("salt",)], group_idx=0,
                        kv_cache_spec_kind="full_attention", session_id="s1"),
        VllmBlockStored(block_hashes=[b"\x07" * 32], parent_block_hash=12,
                        token_ids=list(range(16)), block_size=16, lora_id=3, medium="CPU",
                        lora_name="adapter"),
        VllmBlockRemoved(block_hashes=[11], medium=None, group_idx=0),
        VllmAllBlocksCleared(),
    ])
    ours = decode_batch(msgspec.msgpack.encode(vllm_batch))
    assert ours.ts == 2.0 and ours.data_parallel_rank == 1
    first, second, removed, cleared = ours.events
    assert first.block_hashes == [11, 12] and first.token_ids == list(range(32))
    assert first.extra_keys == [None, ("salt",)] and first.session_id == "s1"
    assert (second.parent_block_hash, second.lora_id, second.lora_name) == (12, 3, "adapter")
    assert second.block_hashes == [b"\x07" * 32]
    assert removed == BlockRemoved(block_hashes=[11], medium=None, group_idx=0)
    assert cleared == AllBlocksCleared()


def test_vllm_batch_without_rank_decodes():
    payload = msgspec.msgpack.encode(VllmKVEventBatch(ts=3.0, events=[VllmAllBlocksCleared()]))
    assert decode_batch(payload) == KVEventBatch(ts=3.0, events=[AllBlocksCleared()])


def test_old_map_shaped_payload_is_rejected():
    with pytest.raises(ValueError):  # a map, not vLLM's array
        decode_batch(msgspec.msgpack.encode({"ts": 1.0, "events": []}))


def test_every_field_is_encoded_even_at_its_default():
    """vLLM's decoder requires lora_id / medium / lora_name: ours always sends them."""
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=0.0, events=[
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1),
        BlockRemoved(block_hashes=[1])])))
    assert raw[1][0]["medium"] == "GPU" and "lora_id" in raw[1][0] and "lora_name" in raw[1][0]
    assert raw[1][1]["medium"] == "GPU"
    decoded = msgspec.msgpack.Decoder(VllmKVEventBatch).decode(encode_batch(KVEventBatch(
        ts=0.0, events=[BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1],
                                    block_size=1)])))
    assert decoded.events[0].medium == "GPU"


def test_round_trip():
    batch = _our_batch()
    assert decode_batch(encode_batch(batch)) == batch
    assert isinstance(batch.events[0], BlockStored)


def test_malformed_payload_is_a_value_error():
    with pytest.raises(ValueError):
        decode_batch(b"\xc1not msgpack")


def test_seq_frames():
    assert decode_seq(encode_seq(7)) == 7
    assert encode_seq(-1) == (-1).to_bytes(8, "big", signed=True)
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(ValueError, match="8 bytes"):
        decode_seq(b"\x00")
