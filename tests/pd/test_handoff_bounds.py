"""A producer's handoff ends in bounded time, so its answer never outlasts a router's prefill
timeout set above the prefill plus `transfer_timeout_s` and the server's margin: a push ends by
its deadline (not SEND_TIMEOUT_MS a chunk), and a rank's job is bounded from the moment it was
started, also when it queued behind a job stuck on a consumer that cannot take its blocks."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from pagedkv.store import transfer_push
from pagedkv.store.tiered import BlockMeta
from pagedkv.store.transfer_config import parse_kv_transfer_config
from pagedkv.store.transfer_push import PushSender
from pagedkv.store.transfer_rank import PUSH_GRACE_S, RankTransfer
from tests.pd.push_wait import wait_for
from tests.server.helpers import free_port

BLOCK_BYTES = 64
TIMEOUT_S = 0.3


class _NeverSavedStore:
    """A rank's store whose saves are never written and whose staging holds every block."""

    tiers: list = []
    grouped = False
    block_bytes = BLOCK_BYTES

    def save_ticket(self) -> int:
        return 1

    def saves_written(self) -> int:
        return 0

    def holds(self, blocks: list) -> list[bool]:
        return [True] * len(blocks)

    def load(self, metas: list) -> list[torch.Tensor]:
        return [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in metas]

    def key(self, block_hash: bytes, group_idx: int | None = None) -> bytes:
        return block_hash


def test_a_push_ends_by_its_deadline():
    assert transfer_push.SEND_TIMEOUT_MS / 1000 > 1.0  # the per-chunk bound alone is longer
    sender = PushSender(layer_groups=4)
    row = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    try:
        start = time.monotonic()
        with pytest.raises(zmq.Again):  # nobody listens: no chunk can be queued
            sender.push(("127.0.0.1", free_port()), [b"k" * 16], [row], BLOCK_BYTES,
                        deadline=start + 0.2)
        assert 0.15 <= time.monotonic() - start < 1.0
        assert sender.num_sockets == 0
    finally:
        sender.close()


def test_jobs_queued_behind_a_stuck_push_end_within_their_own_bound():
    config = parse_kv_transfer_config({
        "kv_role": "kv_producer", "kv_connector": "PagedKVPushConnector",
        "kv_connector_extra_config": {"transfer_timeout_s": TIMEOUT_S}})
    rank = RankTransfer(config, _NeverSavedStore())
    metas = [BlockMeta(bytes([i]) * 16, None, (1, 2, 3, 4)) for i in range(3)]
    dead = [("127.0.0.1", free_port())]  # a consumer that never takes its blocks
    try:
        start = time.monotonic()
        for job_id in range(3):
            rank.start(job_id, metas, dead)
        outcomes: dict[int, dict] = {}

        def all_done() -> bool:
            for job_id in range(3):
                if job_id not in outcomes and (out := rank.poll(job_id)) is not None:
                    outcomes[job_id] = out
            return len(outcomes) == 3

        # each job: its saves' wait to the shared deadline, then at most the push grace;
        # without the bound from `start` each took the whole timeout plus SEND_TIMEOUT_MS
        bound = TIMEOUT_S + 3 * PUSH_GRACE_S + 0.5
        assert wait_for(all_done, 10.0)
        assert time.monotonic() - start < bound
        assert all(o["num_blocks"] == 0 and not o["durable"] for o in outcomes.values())
        assert rank.num_jobs == 0
    finally:
        rank.close()
