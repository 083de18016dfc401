"""AsyncEngine and create_app in-process (ASGI), on the real engine, its core in this process or
in its own (`engine_core_process()`, tests/server/helpers.py): aborts and shutdown return every
block, errors reach the caller, the in-flight bound holds, two apps share a process, utility
calls are awaited without blocking and fail fast once the engine is gone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.server.app import create_app
from tests.server.helpers import engine_core_process


def make_engine(tiny_llama, num_blocks: int = 128) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                max_model_len=256, num_gpu_blocks_override=num_blocks),
                     core_process=engine_core_process())


@pytest.fixture
def engine(tiny_llama):
    engine = make_engine(tiny_llama)
    yield engine
    engine.shutdown()


def assert_pool_empty(engine: LLMEngine) -> None:
    """No block held, the pool consistent, nothing running (read through utility calls, so
    the same with the core in its own process)."""
    engine.check_invariants()
    stats = engine.get_stats()
    assert stats.num_free_blocks == engine.client.ready.num_usable_blocks
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0
    assert not engine.has_unfinished_requests()


LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def test_stream_abort_and_finish(engine):
    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            short = await async_engine.add_request(
                "short", [1, 20, 30], SamplingParams(temperature=0.0, max_tokens=4,
                                                      ignore_eos=True))
            outputs = [o async for o in short]
            short.close()
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
            counts = [len(o.outputs[0].token_ids) for o in outputs]
            # Cumulative; a core that ran ahead of this reader (a core process, or steps
            # faster than the event loop's turn) sends several steps' tokens in one.
            assert counts == sorted(set(counts)) and counts[0] >= 1 and counts[-1] == 4

            long = await async_engine.add_request("long", [1, 20, 30], LONG)
            first = await long.__anext__()
            assert not first.finished
            stats = await async_engine.get_stats()
            assert stats.num_running == 1 and stats.kv_cache_usage > 0
            with pytest.raises(ValueError, match="already in use"):
                await async_engine.add_request("long", [1, 7], LONG)
            assert async_engine.num_in_flight == 1
            long.close()  # aborts it
            rest = [o async for o in long]  # what was queued before the abort, then the end
            assert long.aborted and not any(o.finished for o in rest)
            stats = await async_engine.get_stats()
            assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
            assert async_engine.num_in_flight == 0
        finally:
            async_engine.shutdown()

    asyncio.run(main())
    assert_pool_empty(engine)


def test_errors_and_overload_release_their_slot(engine):
    async def main() -> None:
        async_engine = AsyncEngine(engine, max_pending=1)
        async_engine.start()
        try:
            with pytest.raises(ValueError, match="vocabulary"):
                await async_engine.add_request("bad", [10**6], LONG)
            assert async_engine.num_in_flight == 0
            held = await async_engine.add_request("held", [1, 5], LONG)
            with pytest.raises(EngineOverloadedError):
                await async_engine.add_request("more", [1, 6], LONG)
            held.close()
            again = await async_engine.add_request("again", [1, 7], LONG)
            again.close()
        finally:
            async_engine.shutdown()

    asyncio.run(main())
    assert_pool_empty(engine)


def test_shutdown_aborts_running_requests_and_joins(engine):
    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        streams = [await async_engine.add_request(f"r{i}", [1, 9 + i], LONG) for i in range(3)]
        await streams[0].__anext__()
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        for stream in streams:
            async for _ in stream:  # drains what was sent, then ends (aborted)
                pass
            assert stream.aborted
            stream.close()
        assert not async_engine.is_running
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("late", [1, 2], LONG)

    asyncio.run(main())
    assert_pool_empty(engine)


def test_two_apps_in_one_process_have_their_own_metrics(engine, tiny_llama):
    other = make_engine(tiny_llama, num_blocks=64)
    try:
        app_a = create_app(engine, served_model_name="a")
        app_b = create_app(other, served_model_name="b")
        with TestClient(app_a) as a, TestClient(app_b) as b:
            resp = a.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                                    "ignore_eos": True})
            assert resp.status_code == 200 and resp.json()["model"] == "a"
            assert b.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code \
                == 404
            metrics_a, metrics_b = a.get("/metrics").text, b.get("/metrics").text
        assert 'pagedkv:generation_tokens_total{model_name="a"} 3.0' in metrics_a
        assert 'pagedkv:generation_tokens_total{model_name="b"} 0.0' in metrics_b
        assert_pool_empty(engine)
        assert_pool_empty(other)
    finally:
        other.shutdown()


def test_accessors_read_the_engine_facts(engine, tiny_llama):
    async_engine = AsyncEngine(engine)  # not started: the accessors need no loop
    assert async_engine.tokenizer is engine.tokenizer
    assert async_engine.max_model_len == engine.max_model_len == 256
    config = json.loads((tiny_llama / "config.json").read_text())
    assert async_engine.vocab_size == engine.vocab_size == config["vocab_size"]
    async_engine.check_fits(10, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError):
        async_engine.check_fits(10_000, SamplingParams(max_tokens=4))


@pytest.mark.timeout(120)
def test_utility_calls_wait_on_a_stopped_core_without_blocking_and_fail_fast(tiny_llama):
    """With the core in its own process and stopped (SIGSTOP) the loop thread still takes
    requests while a utility call waits; the call times out; once the core goes on everything
    completes; a core killed under a waiting call fails it at once with EngineDeadError."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=4,
                                  max_model_len=256, num_gpu_blocks_override=128),
                       core_process=True)
    core = engine.client.process

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            assert (await async_engine.get_stats()).num_running == 0
            os.kill(core.pid, signal.SIGSTOP)
            try:
                waiting = asyncio.create_task(async_engine.call_utility("get_stats",
                                                                        timeout=1.0))
                await asyncio.sleep(0.05)
                params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
                stream = await asyncio.wait_for(
                    async_engine.add_request("during", [1, 20, 30], params), 0.5)
                started = time.monotonic()
                with pytest.raises(TimeoutError, match="get_stats"):
                    await waiting
                assert time.monotonic() - started < 1.0
            finally:
                os.kill(core.pid, signal.SIGCONT)
            outputs = [o async for o in stream]
            stream.close()
            assert len(outputs[-1].outputs[0].token_ids) == 5
            stats = await async_engine.get_stats()
            assert stats.generation_tokens == 5 and stats.num_running == 0
            os.kill(core.pid, signal.SIGSTOP)
            waiting = asyncio.create_task(async_engine.call_utility("dashboard.subscribe"))
            await asyncio.sleep(0.05)
            started = time.monotonic()
            os.kill(core.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="engine core"):
                await waiting
            assert time.monotonic() - started < 5.0  # the default timeout is 60 s
            with pytest.raises(EngineDeadError):
                await async_engine.call_utility("get_stats")
        finally:
            async_engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_unknown_utility_calls_are_value_errors(engine):
    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            with pytest.raises(ValueError, match="'scheduler'"):
                await async_engine.call_utility("scheduler")
            with pytest.raises(ValueError, match="12345"):
                await async_engine.call_utility("dashboard.drain", 12345)
            assert (await async_engine.get_stats()).num_running == 0  # the loop went on
        finally:
            async_engine.shutdown()

    asyncio.run(main())
    assert_pool_empty(engine)
