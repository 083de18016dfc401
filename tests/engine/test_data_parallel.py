"""Data parallelism (`data_parallel_size`): N engine cores behind one frontend give the tokens
one core gives, spread the requests, send a prompt to the core holding its prefix, route
aborts and stats per core, and a core that dies ends the stepping with an error naming it."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
import zmq

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.core_client import CoreDeadError
from pagedkv.engine.dp_client import (
    DPCoreClient,
    core_args,
    cpu_share,
    offset_endpoint_port,
)
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.stats import EngineStats, sum_stats
from pagedkv.events.wire import BlockStored, decode_batch
from pagedkv.sched.sampling_params import SamplingParams
from tests.engine.conftest import make_prompts

pytestmark = pytest.mark.timeout(240)


def _args(model_dir, **kw) -> EngineArgs:  # noqa: ANN001
    return EngineArgs(model=str(model_dir), dtype="float32", block_size=4,
                      num_gpu_blocks_override=128, max_model_len=256, seed=0, cpu_threads=1,
                      **kw)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return done


def _batch(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = make_prompts(3, vocab, num=6, shared_prefix=12, lengths=(3, 20))
    batch = {f"g{i}": (p, SamplingParams(max_tokens=8, temperature=0.0))
             for i, p in enumerate(prompts)}
    batch["n2"] = (prompts[1], SamplingParams(max_tokens=6, n=2, seed=5))
    return batch


@pytest.fixture(scope="module")
def event_subs():
    """Two SUB sockets bound on consecutive ports (the cores' publishers connect to them)."""
    context = zmq.Context()
    for _ in range(20):
        first = context.socket(zmq.SUB)
        port = first.bind_to_random_port("tcp://127.0.0.1")
        second = context.socket(zmq.SUB)
        try:
            second.bind(f"tcp://127.0.0.1:{port + 1}")
        except zmq.ZMQError:
            first.close(0)
            second.close(0)
            continue
        for sub in (first, second):
            sub.setsockopt(zmq.SUBSCRIBE, b"")
        yield port, [first, second]
        first.close(0)
        second.close(0)
        context.term()
        return
    pytest.fail("no two consecutive free ports")


@pytest.fixture(scope="module")
def dp_engine(tiny_llama, event_subs):
    events = json.dumps({"enable_kv_cache_events": True,
                         "endpoint": f"tcp://127.0.0.1:{event_subs[0]}"})
    engine = LLMEngine(_args(tiny_llama, data_parallel_size=2, kv_events_config=events))
    yield engine
    engine.shutdown()


def test_two_cores_give_one_cores_tokens_and_share_the_batch(tiny_llama, dp_engine):
    one = LLMEngine(_args(tiny_llama))
    try:
        want = _run(one, _batch(one.vocab_size))
    finally:
        one.shutdown()
    client = dp_engine.client
    assert isinstance(client, DPCoreClient) and dp_engine.core is None
    got = _run(dp_engine, _batch(dp_engine.vocab_size))
    assert got == want
    per_core = dp_engine.call_utility("get_core_stats")
    assert len(per_core) == 2 and all(s.prompt_tokens > 0 for s in per_core)
    assert client.placer.placed[0] + client.placer.placed[1] == len(want)
    assert min(client.placer.placed) >= 2  # both cores took a real share
    total = dp_engine.get_stats()
    assert total.generation_tokens == sum(s.generation_tokens for s in per_core)
    assert total.num_blocks == 2 * per_core[0].num_blocks
    assert client.placer.in_flight == [0, 0] and client.placer.queued_blocks == [0.0, 0.0]
    dp_engine.check_invariants()


def test_each_cores_kv_events_carry_its_rank(dp_engine, event_subs):
    """Core r publishes on the configured port + r, each batch stamped data_parallel_rank=r
    (as vLLM's publishers are)."""
    for sub in event_subs[1]:  # a bound SUB attaches its peers only when called into
        sub.poll(500)
    # Two requests added together: the second goes to the core the first left idle.
    _run(dp_engine, {f"ev{i}": ([30 + i] * 12, SamplingParams(max_tokens=1)) for i in range(2)})
    for rank, sub in enumerate(event_subs[1]):
        ranks, stored = set(), 0
        deadline = time.monotonic() + 10
        while not stored and time.monotonic() < deadline:
            if sub.poll(200):
                batch = decode_batch(sub.recv_multipart()[2])
                ranks.add(batch.data_parallel_rank)
                stored += sum(isinstance(e, BlockStored) for e in batch.events)
        assert stored and ranks == {rank}, (rank, ranks)


def test_a_prompt_goes_to_the_core_holding_its_prefix(dp_engine):
    client = dp_engine.client
    prefix = list(range(40, 72))  # 8 full blocks
    _run(dp_engine, {"warm": (prefix + [5], SamplingParams(max_tokens=1))})
    before = dp_engine.call_utility("get_core_stats")
    holder = client.placer.holder(client.block_hashes(prefix, None))
    assert holder is not None
    # Occupy the holder with a long request: the prefix still wins over one request's load.
    dp_engine.add_request("busy", [9, 8, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    busy_core = client.placer.core_of("busy")
    follow = {f"f{i}": (prefix + [100 + i, 7], SamplingParams(max_tokens=2)) for i in range(3)}
    for rid, (prompt, params) in follow.items():
        dp_engine.add_request(rid, prompt, params)
        assert client.placer.core_of(rid) == holder, (rid, busy_core)
    while dp_engine.has_unfinished_requests():
        dp_engine.step()
    after = dp_engine.call_utility("get_core_stats")
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before,
                                                                       strict=True)]
    assert hits[holder] >= 3 * 32 and hits[1 - holder] == 0
    assert dp_engine.is_prefix_cached(prefix) is True
    info = dp_engine.pin_prefix(prefix)
    assert info.num_blocks == 8
    assert dp_engine.call_utility("get_core_stats")[holder].num_pinned_blocks == 8
    assert dp_engine.unpin_prefix(prefix).num_blocks == 0
    dp_engine.check_invariants()


def test_an_abort_reaches_the_core_holding_the_request(dp_engine):
    client = dp_engine.client
    for rid in ("a0", "a1"):
        dp_engine.add_request(rid, [7, 7, 7, rid == "a1" and 8 or 9],
                              SamplingParams(max_tokens=200, ignore_eos=True))
    assert sorted(client.placer.core_of(r) for r in ("a0", "a1")) == [0, 1]
    for _ in range(3):
        dp_engine.step()
    dp_engine.abort_request(["a0", "a1"])
    assert client.placer.in_flight == [0, 0]
    stats = dp_engine.call_utility("get_core_stats")  # taken after the aborts
    assert [s.num_running + s.num_waiting for s in stats] == [0, 0]
    assert all(s.num_free_blocks == s.num_blocks for s in stats)
    dp_engine.check_invariants()


def test_a_dead_core_ends_the_step_with_an_error_naming_it(dp_engine):
    """(Last of the tests on `dp_engine`: it leaves the engine dead.)"""
    for rid in ("r0", "r1"):
        dp_engine.add_request(rid, [5, 6, rid == "r0" and 7 or 8],
                              SamplingParams(max_tokens=200, ignore_eos=True))
    dp_engine.step()
    os.kill(dp_engine.client.cores[1].process.pid, signal.SIGKILL)
    with pytest.raises(CoreDeadError, match="core 1 of 2.*died"):
        for _ in range(400):
            dp_engine.step()
    assert not dp_engine.is_alive()
    dp_engine.abort_request(["r0", "r1"])  # never raises on a dead core


def test_each_core_gets_its_rank_its_threads_and_its_event_ports(tiny_llama):
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                         "replay_endpoint": "tcp://*:5600"})
    args = dataclasses.replace(_args(tiny_llama, data_parallel_size=2), kv_events_config=events,
                               cpu_threads=None)
    one = core_args(args, 1, num_cpus=8)
    assert one.data_parallel_rank == 1 and one.cpu_threads == 4
    assert json.loads(one.kv_events_config)["endpoint"] == "tcp://*:5558"
    assert json.loads(one.kv_events_config)["replay_endpoint"] == "tcp://*:5601"
    assert core_args(args, 0, num_cpus=8).kv_events_config == events
    assert cpu_share(dataclasses.replace(args, tensor_parallel_size=2), 8) == 2
    assert cpu_share(args, 1) == 1
    assert offset_endpoint_port("ipc:///tmp/ev", 2) == "ipc:///tmp/ev-2"
    assert offset_endpoint_port("tcp://*:*", 1) == "tcp://*:*"
    with pytest.raises(ValueError, match="data_parallel_rank"):
        dataclasses.replace(args, data_parallel_rank=2)
    with pytest.raises(ValueError, match="nnodes"):
        dataclasses.replace(args, nnodes=2, tensor_parallel_size=2, master_port=1234)


def test_summed_stats_weigh_kv_usage_by_pool_size():
    a = EngineStats(num_running=1, kv_cache_usage=0.5, num_blocks=100, prompt_tokens=3,
                    iteration_token_counts=(1, 2), kv_store_tiers=({"name": "cpu", "hits": 2},))
    b = EngineStats(num_running=2, kv_cache_usage=0.0, num_blocks=300, prompt_tokens=4,
                    iteration_token_counts=(0, 5), kv_store_tiers=({"name": "cpu", "hits": 1},))
    total = sum_stats([a, b])
    assert total.num_running == 3 and total.num_blocks == 400 and total.prompt_tokens == 7
    assert abs(total.kv_cache_usage - 0.125) < 1e-12
    assert total.iteration_token_counts == (1, 7)
    assert total.kv_store_tiers == ({"name": "cpu", "hits": 3},)

