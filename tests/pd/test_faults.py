"""Faults of prefill/decode disaggregation end in bounded time with the one-instance answer
(the consumer computes what did not arrive intact) or a clear 400: a push nobody receives, a
push cut midway, a producer that dies after answering, stale or forged params, malformed
params. Never wrong tokens; every block comes back."""

from __future__ import annotations

import json
import logging
import time

import pytest

from tests.pd.conftest import (
    BLOCK_SIZE,
    PREFILL_PARAMS,
    TRANSFER_TIMEOUT_S,
    assert_blocks_back,
    assert_same_answer,
    body,
    cached,
    one_instance,
    pd_pair,
    post,
    prefill,
    utility,
)
from tests.server.helpers import free_port

BOUND_S = TRANSFER_TIMEOUT_S + 5.0  # a fault costs at most the transfer timeout, plus slack


def prompt_of(seed: int, length: int = 33) -> list[int]:
    return [4 + (seed * 31 + i * 13) % 190 for i in range(length)]


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    with pd_pair(tiny_llama, "push", tmp_path_factory.mktemp("pd")) as made:
        yield made



def timed_decode(pair, request: dict, params: dict) -> dict:
    start = time.monotonic()
    answer = post(pair.b, request, params)
    assert time.monotonic() - start < BOUND_S
    return answer


class _CutSocket:
    """A socket that sends the first `keep` messages and silently drops the rest."""

    def __init__(self, sock, keep: int) -> None:
        self.sock, self.keep = sock, keep

    def send_multipart(self, frames, **kwargs) -> None:
        if self.keep > 0:
            self.keep -= 1
            self.sock.send_multipart(frames, **kwargs)


def test_a_push_cut_midway_is_recomputed(pair, monkeypatch, caplog):
    """Two of four layer-group chunks arrive: no block is whole, so none is loaded."""
    sender = pair.producer.core.kv_transfer.sender
    real = sender._socket
    monkeypatch.setattr(sender, "_socket", lambda address: _CutSocket(real(address), 2))
    request = body(prompt_of(1))
    params = prefill(pair.a, request)["kv_transfer_params"]
    assert params["num_tokens"] == 8 * BLOCK_SIZE
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        decoded = timed_decode(pair, request, params)
    assert "0 of 8 pushed blocks arrived" in caplog.text
    assert cached(decoded) == 0
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


def test_blocks_that_arrived_are_loaded_and_the_rest_computed(pair, monkeypatch):
    """The push stops after 3 whole blocks: exactly those are loaded."""
    sender = pair.producer.core.kv_transfer.sender
    real_push = sender.push
    monkeypatch.setattr(sender, "push", lambda address, keys, payloads, *rest:
                        real_push(address, keys[:3], payloads[:3], *rest))
    request = body(prompt_of(2))
    params = prefill(pair.a, request)["kv_transfer_params"]
    decoded = timed_decode(pair, request, params)
    assert cached(decoded) == 3 * BLOCK_SIZE
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


def test_stale_params_of_another_prompt_are_refused_and_recomputed(pair, caplog):
    stale = prefill(pair.a, body(prompt_of(3)))["kv_transfer_params"]
    request = body(prompt_of(4))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        decoded = post(pair.b, request, stale)
    assert time.monotonic() - start < TRANSFER_TIMEOUT_S  # refused without waiting
    assert "block_hashes are not the prompt's" in caplog.text
    assert cached(decoded) == 0
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


@pytest.mark.parametrize("forged", [
    {"model_identity": "00" * 16}, {"kv_format": "kv_cache_dtype=int8;dtype=float32"},
    {"block_size": 16}, {"cache_salt": "someone-else"}, {"transport": "store"},
    {"num_tokens": 4}, {"block_hashes": ["ab" * 32]}])
def test_forged_params_are_refused_with_a_warning(pair, caplog, forged):
    request = body(prompt_of(5))
    params = {**prefill(pair.a, request)["kv_transfer_params"], **forged}
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        decoded = timed_decode(pair, request, params)
    assert "do not fit this request" in caplog.text
    assert_same_answer(decoded, one_instance(pair, request))
    assert_blocks_back(pair)


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": "yes"}, {"do_remote_prefill": True, "block_hashes": 5},
    {"do_remote_prefill": True, "remote_port": "x"}, {"do_remote_prefill": True, "num_tokens": -4},
    "not an object"])
def test_malformed_params_are_a_400(pair, params):
    answer = pair.b.post("/v1/completions", json={**body(prompt_of(6)),
                                                  "kv_transfer_params": params})
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert "kv_transfer_params" in answer.json()["error"]["message"]


def test_a_prefill_cannot_stream_or_carry_several_prompts(pair):
    streamed = pair.a.post("/v1/completions", json={
        **body(prompt_of(7), max_tokens=1), "stream": True, "kv_transfer_params": PREFILL_PARAMS})
    assert streamed.status_code == 400 and "cannot stream" in streamed.text
    several = pair.a.post("/v1/completions", json={
        **body([prompt_of(7), prompt_of(8)], max_tokens=1), "kv_transfer_params": PREFILL_PARAMS})
    assert several.status_code == 400 and "one prompt" in several.text


def test_a_push_nobody_receives_ends_in_bounded_time(tiny_llama, tmp_path):
    """The producer pushes to a port no consumer listens on: its push fails in bounded time
    and it still answers; the consumer, which never receives the blocks, computes the
    prompt."""
    with pd_pair(tiny_llama, "push", tmp_path, consumer_port=free_port()) as lost:
        request = body(prompt_of(9))
        start = time.monotonic()
        params = prefill(lost.a, request)["kv_transfer_params"]
        assert time.monotonic() - start < BOUND_S
        decoded = timed_decode(lost, request, params)
        assert cached(decoded) == 0
        assert_same_answer(decoded, one_instance(lost, request))
        assert_blocks_back(lost)


@pytest.mark.parametrize("connector", ["store", "push"])
def test_a_producer_that_dies_after_answering_loses_nothing(tiny_llama, tmp_path, connector):
    """Its blocks are already in the shared tier, or already pushed: the decode loads them."""
    with pd_pair(tiny_llama, connector, tmp_path) as made:
        request = body(prompt_of(10))
        params = prefill(made.a, request)["kv_transfer_params"]
        made.a.app.state.async_engine.shutdown()
        made.producer.shutdown()
        decoded = timed_decode(made, request, params)
        assert cached(decoded) == 8 * BLOCK_SIZE
        assert_same_answer(decoded, one_instance(made, request))
        utility(made.b, "check_invariants")
        kv = made.consumer.scheduler.kv_cache_manager
        assert kv.pool.get_num_free_blocks() == kv.num_usable_blocks


def test_a_streamed_decode_loads_the_blocks_and_streams_the_same_tokens(pair):
    """The router streams the decode's tokens to its client: the transfer is waited for
    before the stream opens."""
    request = body(prompt_of(11), logprobs=None)
    params = prefill(pair.a, request)["kv_transfer_params"]
    with pair.b.stream("POST", "/v1/completions", json={
            **request, "stream": True, "kv_transfer_params": params,
            "stream_options": {"include_usage": True}}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert cached(chunks[-1]) == 8 * BLOCK_SIZE
    assert text == one_instance(pair, request)["choices"][0]["text"]
    assert_blocks_back(pair)
