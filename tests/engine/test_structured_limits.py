"""Structured outputs under hostile constraints: size limits (ValueError naming the limit), a
compile pool of the backend's own with a per-request timeout, queued compiles dropped when their
client leaves, one compile per constraint, error messages without build paths, unsatisfiable
grammars refused; and a 2-choice request's compile latency stays bounded while big compiles are
in flight or abandoned."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedkv import LLM, SamplingParams, StructuredOutputsParams
from pagedkv.structured.backend import XGrammarBackend
from pagedkv.structured.limits import (
    CompileTimeoutError,
    ConstraintTooLargeError,
    StructuredOutputsLimits,
)

SLOW_S = 2.0  # how long a "big" compile takes (a stand-in for a 20,000-way choice list)
TWO_CHOICES = StructuredOutputsParams(choice=["yes", "no"])
PATIENT_S = 30.0  # a wait whose timeout is not what a test is about


def big(i: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=f"slow-{i}" + "x" * 2000)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", seed=0, block_size=4,
               num_gpu_blocks_override=64).llm_engine


def slow_backend(engine, monkeypatch, gate: threading.Event | None = None,
                 **limits) -> XGrammarBackend:
    """A backend whose compiles of regexes starting "slow" hold a pool thread for SLOW_S
    (sleeping releases the GIL, as xgrammar's C++ compile does), or, given `gate`, until the
    test sets it (so "still running" does not depend on how fast a loaded machine runs the
    test). `big(i)` is such a regex, beyond the pool's small-constraint lane."""
    backend = XGrammarBackend(engine.tokenizer, engine.vocab_size,
                              limits=StructuredOutputsLimits(**limits))
    real = backend._compile

    def compile_(params):
        if params.kind == "regex" and params.regex.startswith("slow"):
            if gate is None:
                time.sleep(SLOW_S)
            else:
                gate.wait(timeout=60)  # bounded: never a thread left behind for ever
        return real(params)

    monkeypatch.setattr(backend, "_compile", compile_)
    return backend


def test_limits_are_value_errors_naming_the_limit(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", seed=0, block_size=4, num_gpu_blocks_override=64,
              structured_outputs_max_choices=3, structured_outputs_max_pattern_chars=10,
              structured_outputs_max_grammar_chars=40, structured_outputs_max_schema_chars=30)
    cases = [
        (dict(choice=["a", "b", "c", "d"]), "max_choices"),
        (dict(choice=["x" * 30, "y" * 30]), "max_grammar_chars"),
        (dict(regex="[a-z]{1,20}xyz"), "max_pattern_chars"),
        (dict(grammar='root ::= "' + "a" * 50 + '"'), "max_grammar_chars"),
        (dict(json={"type": "object", "properties": {"name": {"type": "string"}}}),
         "max_schema_chars"),
    ]
    for so, limit in cases:
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**so))
        with pytest.raises(ConstraintTooLargeError, match=f"structured_outputs_{limit}"):
            llm.generate(["a"], params, use_tqdm=False)
    # Within the limits: served.
    out = llm.generate(["a"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["a", "b"])), use_tqdm=False)[0].outputs[0]
    assert out.text in ("a", "b") and out.finish_reason == "stop"
    llm.llm_engine.check_invariants()


def test_bad_limit_values_are_value_errors(tiny_llama):
    from pagedkv.engine.args import EngineArgs

    for name, value in [("structured_outputs_max_choices", 0),
                        ("structured_outputs_compile_timeout_s", float("nan")),
                        ("structured_outputs_compile_threads", -1)]:
        with pytest.raises(ValueError, match=name):
            EngineArgs(model=str(tiny_llama), **{name: value})


def test_errors_carry_no_build_paths_and_unsatisfiable_is_said(engine):
    backend = engine.structured_output_backend
    for so in (dict(regex="(unclosed"), dict(grammar="root ::= undefined_rule"),
               dict(json={"type": "string", "minLength": 5, "maxLength": 2})):
        with pytest.raises(ValueError) as info:
            backend.compile(StructuredOutputsParams(**so))
        message = str(info.value)
        assert "/project" not in message and ".cc" not in message and "[" not in message[:12]
        assert message.startswith("invalid structured_outputs.")
    with pytest.raises(ValueError, match="unsatisfiable"):
        backend.compile(StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]"))


def test_compile_timeout_and_one_compile_per_constraint(engine, monkeypatch):
    gate = threading.Event()  # the slow compile runs until the test ends
    backend = slow_backend(engine, monkeypatch, gate=gate, compile_timeout_s=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(CompileTimeoutError, match="compile_timeout_s"):
            backend.compile(StructuredOutputsParams(regex="slow-a"))
        waited = time.monotonic() - started
        # The compile never ends by itself: the timeout ended the wait, after 0.3 s (the
        # margin is for a loaded machine's scheduling only).
        assert 0.3 - 0.05 <= waited < 0.3 + 3.0, waited
        assert not gate.is_set() and backend.num_compilations == 0

        async def three_waiters():
            # Their own generous timeout: what is tested here is the sharing, not the clock.
            so = StructuredOutputsParams(regex="[0-9]+")
            return await asyncio.gather(*(backend.compile_async(so, timeout=PATIENT_S)
                                          for _ in range(3)))

        first, *rest = asyncio.run(three_waiters())
        assert all(r is first for r in rest)
        assert backend.num_compilations == 1  # the slow one is still running (abandoned)
        assert backend.cached(StructuredOutputsParams(regex="slow-a")) is None
    finally:
        gate.set()


def test_a_task_for_a_constraint_just_cached_does_not_compile_it_again(engine):
    """The race a loaded machine exposed: a caller misses the cache, the compile of the same
    constraint finishes and leaves the pool, the caller submits a new task. That task answers
    the cached grammar: one compile per constraint, every caller the same object."""
    backend = XGrammarBackend(engine.tokenizer, engine.vocab_size)
    so = StructuredOutputsParams(regex="[a-z]+")
    first = backend.compile(so)
    ticket = backend._submit(so)  # what the late caller does after its cache miss
    try:
        again = ticket.future.result(PATIENT_S)
    finally:
        backend.pool.release(ticket)
        backend.close()
    assert again is first and backend.num_compilations == 1


async def until(predicate, timeout_s: float = 10.0) -> None:
    """Poll `predicate` on the event loop until it holds; bounded (TimeoutError)."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(poll(), timeout_s)


def test_a_queued_compile_whose_client_left_never_runs(engine, monkeypatch):
    gate = threading.Event()  # the busy compile holds the only thread until the test says
    backend = slow_backend(engine, monkeypatch, gate=gate, compile_threads=1,
                           compile_timeout_s=30)

    async def scenario():
        busy = asyncio.ensure_future(backend.compile_async(big(1)))
        await until(lambda: backend.pool.num_started == 1)
        gone = asyncio.ensure_future(backend.compile_async(big(2)))
        await asyncio.sleep(0.1)  # `gone` has submitted (its first step ran at once)
        gone.cancel()  # the client disconnected while its compile was queued
        with pytest.raises(asyncio.CancelledError):
            await gone
        gate.set()
        await busy

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
    assert backend.pool.num_started == 1 and backend.pool.num_dropped == 1
    assert backend.cached(big(2)) is None


@pytest.mark.parametrize("big_clients_leave", [True, False])
def test_two_choice_latency_is_bounded_while_big_compiles_run(engine, monkeypatch,
                                                               big_clients_leave):
    """Six clients send big constraints; either they leave (disconnect) at once, or they stay
    and time out. Meanwhile a 2-choice request compiles within the timeout plus a margin,
    far below what waiting behind a big compile would take (they run until the test ends;
    the 2-choice request may wait up to PATIENT_S, so only its latency bound can fail)."""
    timeout = 0.5
    gate = threading.Event()
    threads_before = threading.active_count()  # other tests' threads may live in this process
    backend = slow_backend(engine, monkeypatch, gate=gate, compile_timeout_s=timeout,
                           compile_threads=2)
    bound = timeout + 3.0  # the margin is for a loaded machine; blocked would be PATIENT_S

    async def scenario():
        bigs = [asyncio.ensure_future(backend.compile_async(big(i))) for i in range(6)]
        await until(lambda: backend.pool.num_started == 2)  # two running, four queued
        if big_clients_leave:
            for task in bigs:
                task.cancel()
            await asyncio.sleep(0)
        started = time.monotonic()
        await backend.compile_async(TWO_CHOICES, timeout=PATIENT_S)
        latency = time.monotonic() - started
        results = await asyncio.gather(*bigs, return_exceptions=True)
        return latency, results

    try:
        latency, results = asyncio.run(scenario())
    finally:
        gate.set()
    assert latency < bound, latency
    expected = asyncio.CancelledError if big_clients_leave else CompileTimeoutError
    assert all(isinstance(r, expected) for r in results), results
    # The queued big compiles never ran: only the two that had started when they were left.
    assert backend.pool.num_started == 2 + 1
    assert backend.pool.num_dropped == 4
    assert threading.active_count() - threads_before < 20  # no thread per request
    backend.close()


def test_the_compile_pool_stops_with_its_backend(engine, monkeypatch):
    before = set(threading.enumerate())
    backend = slow_backend(engine, monkeypatch)
    backend.compile(TWO_CHOICES)
    workers = [t for t in set(threading.enumerate()) - before
               if t.name.startswith("grammar-compile")]
    assert workers
    backend.close()
    for worker in workers:
        worker.join(timeout=5)
    assert not any(worker.is_alive() for worker in workers)
    with pytest.raises(RuntimeError, match="closed"):
        backend.compile(StructuredOutputsParams(regex="[a-z]"))
