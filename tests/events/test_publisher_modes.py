"""vLLM's publisher behaviour: connect vs bind, the replay endpoint, and its config keys."""

from __future__ import annotations

import time

import pytest
import zmq

from pagedkv.events import wire
from pagedkv.events.config import parse_kv_events_config
from pagedkv.events.publisher import ZmqEventPublisher, is_bind_endpoint, make_event_publisher

H = [bytes([i]) * 32 for i in range(8)]


def _stored(i: int) -> wire.BlockStored:
    return wire.block_stored([H[i]], None, [i] * 4, 4)


def test_bind_connect_rule_is_vllms():
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("tcp://127.0.0.1:*")
    assert is_bind_endpoint("tcp://[::]:5557") and is_bind_endpoint("ipc:///tmp/kv")
    assert is_bind_endpoint("inproc://kv")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")
    assert not is_bind_endpoint("tcp://indexer.local:5557")


def test_connects_to_a_subscriber_that_binds():
    """The llm-d wiring: the indexer binds, the engines connect to it."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    publishers = [ZmqEventPublisher(endpoint, topic="kv") for _ in range(2)]
    try:
        assert all(p.endpoint == endpoint for p in publishers)  # connected, as given
        # slow joiner: the bound SUB attaches a new peer (and sends it the subscription) only
        # when it is called into, so poll a while before publishing
        assert not sub.poll(500)
        for i, publisher in enumerate(publishers):
            publisher.publish([_stored(i)])
        got = []
        while len(got) < 2 and sub.poll(5000):
            got.append(sub.recv_multipart())
    finally:
        for publisher in publishers:
            publisher.close()
        sub.close(0)
        context.term()
    assert sorted(wire.decode_batch(f[2]).events[0].block_hashes[0] for f in got) == H[:2]
    assert all(f[0] == b"kv" and wire.decode_seq(f[1]) == 0 for f in got)


def test_replay_answers_with_the_batches_since_a_sequence_number():
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv",
                                  replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert publisher.replay_endpoint.startswith("tcp://127.0.0.1:")
        for i in range(5):
            publisher.publish([_stored(i)])
        deadline = time.monotonic() + 5
        while len(publisher._buffer) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])  # identity added by the ROUTER
        messages = []
        while dealer.poll(5000):
            messages.append(dealer.recv_multipart())
            if wire.decode_seq(messages[-1][2]) == wire.END_SEQ:
                break
    finally:
        dealer.close(0)
        context.term()
        publisher.close()
    # [b"", topic, seq, payload] per batch from seq 3 on, then [b"", b"", END_SEQ, b""]
    assert [m[:3] for m in messages[:-1]] == [[b"", b"kv", wire.encode_seq(s)] for s in (3, 4)]
    assert [wire.decode_batch(m[3]).events[0].block_hashes for m in messages[:-1]] == \
        [[H[3]], [H[4]]]
    assert messages[-1] == [b"", b"", wire.encode_seq(-1), b""]


def test_replay_keeps_only_buffer_steps():
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                  buffer_steps=2)
    try:
        for i in range(4):
            publisher.publish([_stored(i)])
        deadline = time.monotonic() + 5
        while publisher._seq < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [seq for seq, _ in publisher._buffer] == [2, 3]
    finally:
        publisher.close()


def test_vllm_config_keys_are_accepted_and_honoured():
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",'
        ' "replay_endpoint": "tcp://127.0.0.1:*", "buffer_steps": 7, "hwm": 50,'
        ' "max_queue_size": 1, "topic": "t"}')
    publisher = make_event_publisher(config)
    try:
        assert publisher._buffer.maxlen == 7 and publisher._queue.maxsize == 1
        assert publisher.replay_endpoint.startswith("tcp://127.0.0.1:")
        assert publisher._hwm == 50
    finally:
        publisher.close()


@pytest.mark.parametrize("bad", ['{"buffer_steps": -1}', '{"hwm": "many"}',
                                 '{"max_queue_size": 0}', '{"replay_endpoint": 5}'])
def test_bad_values_of_the_new_keys_are_value_errors(bad):
    with pytest.raises(ValueError, match="kv_events_config"):
        parse_kv_events_config(bad)


def test_a_busy_bind_address_is_a_value_error():
    first = ZmqEventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ValueError, match="cannot open"):
            ZmqEventPublisher(first.endpoint.replace("127.0.0.1", "*"))
    finally:
        first.close()


def test_publisher_null_means_vllms_default():
    config = parse_kv_events_config({"enable_kv_cache_events": True, "publisher": None})
    assert config.publisher == "zmq" and config.enabled
    assert config.replay_endpoint is None and config.buffer_steps == 10_000
    assert (config.hwm, config.max_queue_size) == (100_000, 100_000)  # vLLM 0.32's defaults
