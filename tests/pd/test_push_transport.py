"""The push transport on loopback, without an engine: blocks pushed in layer-group chunks are
reassembled byte for byte; a corrupt, incomplete, expired or over-budget block is never served;
and the kv_transfer_config option's validation."""

from __future__ import annotations

import time

import pytest
import torch

from pagedkv.engine.args import EngineArgs
from pagedkv.store.transfer_config import parse_kv_transfer_config
from pagedkv.store.transfer_push import PushReceiverTier, PushSender, chunk_bounds
from tests.pd.push_wait import wait_for
from tests.server.helpers import free_port

BLOCK_BYTES = 1000  # not a multiple of the chunk count: the last slice is longer


@pytest.fixture
def link():
    port = free_port()
    receiver = PushReceiverTier("127.0.0.1", port, capacity_bytes=10 * BLOCK_BYTES, hold_s=30.0)
    sender = PushSender(layer_groups=3)
    yield sender, receiver, ("127.0.0.1", port)
    sender.close()
    receiver.close()


def blocks(n: int, seed: int = 0) -> tuple[list[bytes], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=gen)
            for _ in range(n)]
    return [bytes([seed, i]) * 8 for i in range(n)], rows


def test_chunks_cover_the_block_once():
    bounds = chunk_bounds(BLOCK_BYTES, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == BLOCK_BYTES
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert chunk_bounds(2, 8) == [(0, 1), (1, 2)]


def test_pushed_blocks_arrive_whole_and_are_taken_once(link):
    sender, receiver, address = link
    keys, rows = blocks(4)
    sent = sender.push(address, keys, rows, BLOCK_BYTES)
    assert sent == 4 * BLOCK_BYTES
    assert wait_for(lambda: all(receiver.contains_many(keys)))
    got = receiver.get_many(keys[:2] + [b"unknown"])
    assert [bytes(g) for g in got[:2]] == [bytes(r.numpy()) for r in rows[:2]] and got[2] is None
    assert receiver.contains_many(keys) == [False, False, True, True]  # a load takes them
    assert receiver.put_many([(b"k", b"x" * BLOCK_BYTES)]) == []  # only the wire fills it
    assert receiver.bytes_received == 4 * BLOCK_BYTES and receiver.num_blocks == 2


class _Lossy:
    """Sends through `sock`, changing or dropping messages: `edit(i, frames)` gives the frames
    to send for message i, or None to drop it (i counts messages, not the sender's retries of
    one that the socket could not take yet)."""

    def __init__(self, sock, edit) -> None:
        self.sock, self.edit, self.count = sock, edit, 0

    def send_multipart(self, frames, **kwargs) -> None:
        edited = self.edit(self.count, frames)
        if edited is not None:  # zmq.Again (not connected yet): the sender retries this message
            self.sock.send_multipart(edited, **kwargs)
        self.count += 1  # counted once sent (or dropped), not per attempt


def push_through(sender, address, edit, keys, rows) -> None:
    sock = sender._socket(address)
    sender._sockets[address] = _Lossy(sock, edit)
    try:
        sender.push(address, keys, rows, BLOCK_BYTES)
    finally:
        sender._sockets[address] = sock


def test_an_incomplete_block_is_never_served(link):
    sender, receiver, address = link
    keys, rows = blocks(2, seed=1)
    push_through(sender, address, lambda i, frames: None if i == 2 else frames, keys, rows)
    keys2, rows2 = blocks(1, seed=2)  # an intact push after them arrives
    sender.push(address, keys2, rows2, BLOCK_BYTES)
    assert wait_for(lambda: receiver.contains_many(keys2)[0])
    assert receiver.contains_many(keys) == [False, False]


def test_a_corrupt_block_fails_its_checksum(link):
    sender, receiver, address = link
    keys, rows = blocks(1, seed=3)

    def flip(i, frames):
        return [frames[0], bytes([frames[1][0] ^ 1]) + frames[1][1:]] if i == 1 else frames

    push_through(sender, address, flip, keys, rows)
    assert wait_for(lambda: receiver.blocks_dropped == 1)
    assert receiver.contains_many(keys) == [False]


def test_held_blocks_are_bounded_in_bytes_and_time():
    port = free_port()
    receiver = PushReceiverTier("127.0.0.1", port, capacity_bytes=3 * BLOCK_BYTES, hold_s=0.3)
    sender = PushSender(layer_groups=1)
    try:
        keys, rows = blocks(5, seed=4)
        sender.push(("127.0.0.1", port), keys, rows, BLOCK_BYTES)
        assert wait_for(lambda: receiver.blocks_received == 5)
        assert receiver.contains_many(keys) == [False, False, True, True, True]  # oldest dropped
        assert receiver.used_bytes == 3 * BLOCK_BYTES
        time.sleep(0.4)
        assert receiver.contains_many(keys) == [False] * 5  # expired
        assert receiver.used_bytes == 0 and receiver.blocks_dropped == 5
    finally:
        sender.close()
        receiver.close()


def test_a_port_in_use_is_a_clear_error():
    port = free_port()
    first = PushReceiverTier("127.0.0.1", port, capacity_bytes=BLOCK_BYTES, hold_s=1.0)
    try:
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            PushReceiverTier("127.0.0.1", port, capacity_bytes=BLOCK_BYTES, hold_s=1.0)
    finally:
        first.close()


@pytest.mark.parametrize(("value", "message"), [
    ("{bad", "not valid JSON"), ("[1]", "must be a JSON object"),
    ({"kv_role": "kv_producer"}, "needs 'kv_connector'"),
    ({"kv_role": "prefill", "kv_connector": "PagedKVPushConnector"}, "kv_role must be one of"),
    ({"kv_role": "kv_both", "kv_connector": "NixlConnector"}, "kv_connector must be one of"),
    ({"kv_role": "kv_both", "kv_connector": "PagedKVPushConnector", "kv_port": 0}, "kv_port"),
    ({"kv_role": "kv_both", "kv_connector": "PagedKVPushConnector", "kv_port": "1"}, "kv_port"),
    ({"kv_role": "kv_both", "kv_connector": "PagedKVPushConnector", "colour": 1}, "unknown keys"),
    ({"kv_role": "kv_both", "kv_connector": "PagedKVPushConnector",
      "kv_connector_extra_config": {"consumers": ["nohost"]}}, "'host:port'"),
    ({"kv_role": "kv_both", "kv_connector": "PagedKVPushConnector",
      "kv_connector_extra_config": {"transfer_timeout_s": 0}}, "transfer_timeout_s must be > 0"),
    ({"kv_role": "kv_both", "kv_connector": "PagedKVPushConnector",
      "kv_connector_extra_config": {"retries": 3}}, "unknown keys"),
])
def test_bad_kv_transfer_config_names_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer_config(value)


def test_a_good_config_parses_with_vllm_names():
    config = parse_kv_transfer_config('{"kv_role": "kv_both", "kv_connector": '
                                      '"PagedKVPushConnector", "kv_port": 20001, '
                                      '"kv_connector_extra_config": {"consumers": ["h:1"]}}')
    assert config.is_producer and config.is_consumer and config.is_push
    assert config.consumers == (("h", 1),) and config.kv_port == 20001


def test_engine_args_check_the_connector_against_the_rest(tiny_llama):
    store = '{"kv_role": "kv_consumer", "kv_connector": "PagedKVStoreConnector"}'
    with pytest.raises(ValueError, match="through a shared tier"):
        EngineArgs(model=str(tiny_llama), kv_transfer_config=store)
    push = '{"kv_role": "kv_consumer", "kv_connector": "PagedKVPushConnector"}'
    with pytest.raises(ValueError, match="every tensor-parallel rank on one machine"):
        EngineArgs(model=str(tiny_llama), kv_transfer_config=push, tensor_parallel_size=2,
                   nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineArgs(model=str(tiny_llama), kv_transfer_config=push, enable_prefix_caching=False)
