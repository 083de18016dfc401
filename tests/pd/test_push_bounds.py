"""The push transport's memory stays bounded against what arrives on its port and where it is
told to push: a header naming a huge block or chunk count, slices of blocks that never complete,
chunks that disagree with their block's first slice, and consumer addresses that never answer
(their sockets are closed, not kept)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import zmq

from pagedkv.store import transfer_push
from pagedkv.store.codec import block_checksum
from pagedkv.store.transfer_push import PushReceiverTier, PushSender
from tests.pd.push_wait import WAIT_S, wait_for
from tests.server.helpers import free_port

BLOCK_BYTES = 1000
CAPACITY = 4 * BLOCK_BYTES


@pytest.fixture
def receiver():
    port = free_port()
    tier = PushReceiverTier("127.0.0.1", port, capacity_bytes=CAPACITY, hold_s=30.0,
                            block_bytes=BLOCK_BYTES)
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    tier.raw = sock
    tier.address = ("127.0.0.1", port)
    yield tier
    context.destroy(linger=0)
    tier.close()


def send(receiver, block_keys: list[bytes], body: bytes, **header) -> None:
    fields = {"keys": [k.hex() for k in block_keys], "checksums": [0] * len(block_keys),
              "chunk": 0,
              "chunks": 1, "block_bytes": BLOCK_BYTES, **header}
    receiver.raw.send_multipart([json.dumps(fields).encode(), body])


def a_good_block_still_arrives(receiver, seed: int) -> None:
    sender = PushSender(layer_groups=2)
    try:
        key = bytes([seed]) * 16
        row = torch.full((BLOCK_BYTES,), seed, dtype=torch.uint8)
        sender.push(receiver.address, [key], [row], BLOCK_BYTES)
        assert wait_for(lambda: receiver.contains_many([key]) == [True])
    finally:
        sender.close()


# (header fields, the body's length: what the header's own slice size asks for, so that only
# the header's claim is wrong)
BAD_HEADERS = [
    ({"block_bytes": 2**40, "chunks": 2**30}, 1024), ({"block_bytes": 999}, 999),
    ({"block_bytes": 0}, 0), ({"chunks": 10**9, "chunk": 5}, 1), ({"chunk": 3}, BLOCK_BYTES),
    ({"chunk": -1}, BLOCK_BYTES), ({"keys": ["zz"]}, BLOCK_BYTES),
    ({"checksums": []}, BLOCK_BYTES), ({"block_bytes": "1000"}, BLOCK_BYTES),
    ({"checksums": ["0"]}, BLOCK_BYTES)]


@pytest.mark.parametrize(("header", "body_len"), BAD_HEADERS)
def test_a_header_that_cannot_be_true_costs_nothing(receiver, header, body_len):
    send(receiver, [b"k" * 16], b"\0" * body_len, **header)
    a_good_block_still_arrives(receiver, 1)
    assert receiver.held_bytes == BLOCK_BYTES  # the good block only
    assert receiver.contains_many([b"k" * 16]) == [False]


def test_without_a_known_block_size_the_capacity_bounds_it():
    tier = PushReceiverTier("127.0.0.1", free_port(), capacity_bytes=CAPACITY, hold_s=30.0)
    try:
        with pytest.raises(ValueError, match="block_bytes"):
            tier._read_header({"keys": ["00"], "checksums": [0], "chunk": 0, "chunks": 4,
                               "block_bytes": CAPACITY + 4}, b"\0" * (CAPACITY // 4 + 1))
    finally:
        tier.close()


def test_slices_that_never_complete_count_against_the_capacity(receiver):
    """Half of each of 20 blocks arrives: never more than the capacity is held, and whole
    blocks still arrive after them."""
    for i in range(20):
        send(receiver, [bytes([i]) * 16], b"\1" * (BLOCK_BYTES // 2), chunks=2)
    assert wait_for(lambda: receiver.blocks_dropped >= 20 - CAPACITY // BLOCK_BYTES)
    assert receiver.held_bytes <= CAPACITY
    a_good_block_still_arrives(receiver, 2)
    assert receiver.held_bytes <= CAPACITY


def test_a_slice_that_disagrees_with_its_block_drops_it(receiver):
    key = b"d" * 16
    send(receiver, [key], b"\1" * (BLOCK_BYTES // 2), chunks=2)
    send(receiver, [key], b"\1" * (BLOCK_BYTES // 4), chunks=4, chunk=3)
    assert wait_for(lambda: receiver.blocks_dropped >= 1)
    data = b"\2" * BLOCK_BYTES
    checksum = block_checksum(key, data)
    send(receiver, [key], data, checksums=[checksum])
    assert wait_for(lambda: receiver.contains_many([key]) == [True])
    assert receiver.get_many([key]) == [data]
    assert receiver.held_bytes == 0


def test_consumers_that_never_answer_leave_no_socket_behind(monkeypatch):
    monkeypatch.setattr(transfer_push, "SEND_TIMEOUT_MS", 50)
    sender = PushSender(layer_groups=2)
    row = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    try:
        for _ in range(3):
            with pytest.raises(zmq.Again):
                sender.push(("127.0.0.1", free_port()), [b"x" * 16], [row], BLOCK_BYTES)
        assert sender.num_sockets == 0
    finally:
        sender.close()


def test_the_sender_keeps_at_most_max_sockets(monkeypatch):
    monkeypatch.setattr(transfer_push, "MAX_SOCKETS", 2)
    receivers = [PushReceiverTier("127.0.0.1", free_port(), CAPACITY, 30.0) for _ in range(3)]
    sender = PushSender(layer_groups=1)
    row = torch.ones(BLOCK_BYTES, dtype=torch.uint8)
    try:
        for i, tier in enumerate(receivers):
            address = ("127.0.0.1", int(tier._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
                                        .rsplit(":", 1)[1]))
            deadline = time.monotonic() + WAIT_S
            while True:  # the first push may find the connection not yet up
                try:
                    sender.push(address, [bytes([i]) * 16], [row], BLOCK_BYTES)
                    break
                except zmq.Again:
                    assert time.monotonic() < deadline
            assert sender.num_sockets <= 2
        assert wait_for(lambda: receivers[2].contains_many([b"\2" * 16]) == [True])
    finally:
        sender.close()
        for tier in receivers:
            tier.close()
