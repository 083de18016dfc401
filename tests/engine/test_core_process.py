"""The engine core in its own process (issue 26): the same outputs as the in-process core, its
errors re-raised by type in the frontend, utility calls (stats, pins, invariants), the wire
codec, and a core that dies ends the stepping with a clear error (no hang)."""

from __future__ import annotations

import os
import signal

import pytest

from pagedkv.config.errors import ErrorKind
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.core_client import CoreDeadError
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.messages import (
    Abort,
    Codec,
    CoreInput,
    CoreOutput,
    CoreStepOutputs,
    EngineCoreRequest,
    params_from_wire,
)
from pagedkv.kv.pins import NotPinnedError
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.structured.params import StructuredOutputsParams

pytestmark = pytest.mark.timeout(240)


def _args(model_dir) -> EngineArgs:  # noqa: ANN001
    return EngineArgs(model=str(model_dir), dtype="float32", block_size=4,
                      num_gpu_blocks_override=128, max_model_len=256, seed=0,
                      cpu_threads=1)  # the same float sums in both processes


GREEDY_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
_STOP: dict[str, str] = {}  # a stop string the greedy text contains (set by `reference`)


def _workload(engine: LLMEngine) -> dict[str, list[tuple]]:
    engine.add_request("greedy", GREEDY_PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
    engine.add_request("n2", "hello world", SamplingParams(max_tokens=8, n=2, seed=3, logprobs=2))
    engine.add_request("stop", GREEDY_PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                             stop=[_STOP["text"]]))
    engine.add_request("plogp", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, prompt_logprobs=1,
                                                                temperature=0.0))
    engine.add_request("aborted", [9, 9, 9, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    done: dict[str, list[tuple]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.outputs or out.finished
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                         c.cumulative_logprob, c.logprobs)
                                        for c in out.outputs] + [out.prompt_logprobs]
        steps += 1
        if steps == 3:
            engine.abort_request("aborted")
    return done


def _assert_close(got, want, where: str = "outputs") -> None:  # noqa: ANN001
    """Equal structure, tokens and texts; floats within 1e-4 (not rounded: a value next to a
    rounding edge would flip on a last-bit difference)."""
    if isinstance(want, float) and isinstance(got, float):
        assert abs(got - want) <= 1e-4, f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: {got} != {want}"
        for key in want:
            _assert_close(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list[tuple]]:
    engine = LLMEngine(_args(tiny_llama))
    try:
        engine.add_request("probe", GREEDY_PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
        text = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
        _STOP["text"] = text[len(text) // 2:len(text) // 2 + 2]
        done = _workload(engine)
        engine.check_invariants()
        return done
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def mp_engine(tiny_llama):
    engine = LLMEngine(_args(tiny_llama), core_process=True)
    yield engine
    engine.shutdown()


def test_core_process_gives_the_in_process_outputs(mp_engine, reference):
    done = _workload(mp_engine)
    assert set(done) == {"greedy", "n2", "stop", "plogp"}  # "aborted" ends without an output
    # Tokens and texts exactly; log-probabilities to 1e-4 (the core process may run another
    # torch thread count, so float sums may round differently in the last bits).
    _assert_close(done, reference)
    stop = _STOP["text"]
    assert done["stop"][0][2:4] == ("stop", stop) and stop not in done["stop"][0][1]
    assert done["greedy"][0][1].startswith(done["stop"][0][1] + stop)
    assert len(done["n2"]) == 3 and done["n2"][0][0] != done["n2"][1][0]
    mp_engine.check_invariants()
    stats = mp_engine.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    assert stats.generation_tokens > 0 and stats.prompt_tokens > 0


def test_core_process_errors_come_back_by_type(mp_engine):
    with pytest.raises(ValueError, match="max_model_len"):
        mp_engine.add_request("long", list(range(4, 300)), SamplingParams())
    with pytest.raises(ValueError, match="structured|grammar|regex|json|schema|Invalid"):
        mp_engine.add_request("so", [5, 6], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    assert not mp_engine.has_unfinished_requests()
    prompt = list(range(10, 30))  # 5 full blocks of 4
    with pytest.raises(NotPinnedError):
        mp_engine.unpin_prefix(prompt)
    assert mp_engine.is_prefix_cached(prompt) is False
    mp_engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    while mp_engine.has_unfinished_requests():
        mp_engine.step()
    assert mp_engine.is_prefix_cached(prompt) is True
    info = mp_engine.pin_prefix(prompt)
    assert info.num_blocks == info.num_prompt_blocks == 5
    assert mp_engine.get_stats().num_pinned_blocks == 5
    assert mp_engine.unpin_prefix(prompt).num_blocks == 0
    mp_engine.check_invariants()


def test_wire_codec_round_trips_requests_and_outputs():
    codec = Codec()
    params = SamplingParams(n=2, stop=["x", "yz"], logit_bias={3: 1.5}, seed=7, logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=["a", "b"]),
                            bad_words=["no"], max_tokens=9)
    request = EngineCoreRequest("r1", [1, 2, 3], params, 12.5, priority=-1, cache_salt="s",
                                bad_words_token_ids=[[4], [5, 6]])
    back = codec.decode_frontend(codec.encode(CoreInput(request))).request
    assert params_from_wire(back.sampling_params) == params
    assert (back.request_id, back.prompt_token_ids, back.arrival_time, back.priority,
            back.cache_salt, back.bad_words_token_ids) == ("r1", [1, 2, 3], 12.5, -1, "s",
                                                           [[4], [5, 6]])
    abort = codec.decode_frontend(codec.encode(Abort(["r1#1"], "stop", "x")))
    assert abort == Abort(["r1#1"], "stop", "x")
    out = CoreOutput("r1#1", [7, 8], new_logprobs=[{7: -0.5}, {8: -1.0, 2: -2.0}],
                     finish_reason="stop", stop_reason=2, parent_id="r1", sample_index=1)
    assert codec.decode_core(codec.encode(CoreStepOutputs([out]))).outputs == [out]
    failed = CoreOutput("r2", finish_reason="error", error="boom", error_kind=ErrorKind.INTERNAL)
    (back_failed,) = codec.decode_core(codec.encode(CoreStepOutputs([failed]))).outputs
    assert back_failed == failed and back_failed.error_kind is ErrorKind.INTERNAL


def test_a_killed_core_ends_the_step_with_a_clear_error(tiny_llama):
    engine = LLMEngine(_args(tiny_llama), core_process=True)
    try:
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        os.kill(engine.client.process.pid, signal.SIGKILL)
        with pytest.raises(CoreDeadError, match="died"):
            for _ in range(200):  # outputs already sent may still arrive first
                engine.step()
        assert not engine.is_alive()
        engine.abort_request("r")  # never raises on a dead core
    finally:
        engine.shutdown()


def test_llm_with_a_core_process_generates_the_in_process_tokens(tiny_llama, reference):
    from pagedkv import LLM

    llm = LLM(str(tiny_llama), core_process=True, dtype="float32", block_size=4,
              num_gpu_blocks_override=128, max_model_len=256, seed=0)
    try:
        out = llm.generate([GREEDY_PROMPT], SamplingParams(max_tokens=12, temperature=0.0),
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids == reference["greedy"][0][0]
    finally:
        llm.shutdown()


def test_a_core_that_fails_to_start_raises_at_once_and_exits_by_itself(tiny_llama, caplog):
    """A ValueError while the core builds (an int8 KV cache too small for one block) comes
    back by type, and the core exits by itself: the frontend neither waits out its 30 s stop
    timeout nor kills it (the failed core left a socket open, so it hung in its exit)."""
    import time

    args = EngineArgs(model=str(tiny_llama), kv_cache_dtype="int8", kv_cache_memory_bytes=1000,
                      block_size=4, seed=0)
    started = time.monotonic()
    with pytest.raises(ValueError, match="room for 1 blocks of 640 bytes"):
        LLMEngine(args, core_process=True)
    assert time.monotonic() - started < 30
    assert "killing it" not in caplog.text
