"""Step outputs hold views of the engine's growing lists (O(new tokens) per step, issue 26):
each step's `RequestOutput` stays exactly what it was after later steps, in both core modes,
and reads as plain lists."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import CompletionOutput
from pagedkv.engine.prefix_view import PrefixView


def test_prefix_view_reads_only_its_prefix():
    items = [10, 11, 12]
    view = PrefixView(items)
    items += [13, 14]  # the owner appends: the view does not see it
    assert len(view) == 3 and list(view) == [10, 11, 12]
    assert view[0] == 10 and view[-1] == 12 and view[1:] == [11, 12] and view[::-1] == [12, 11, 10]
    assert view[-5:] == [10, 11, 12] and view[5:] == [] and view[::2] == [10, 12]
    with pytest.raises(IndexError):
        view[3]  # noqa: B018 - item 3 exists in the list, not in the view
    with pytest.raises(IndexError):
        view[-4]  # noqa: B018
    assert view == [10, 11, 12] and [10, 11, 12] == view and view == (10, 11, 12)  # noqa: SIM300
    assert view != [10, 11, 12, 13] and view != items and view == PrefixView(items, 3)
    assert view + [0] == [10, 11, 12, 0] and [0] + view == [0, 10, 11, 12]
    assert repr(view) == "[10, 11, 12]" and 12 in view and 13 not in view
    assert view.index(11) == 1 and view.count(13) == 0 and bool(PrefixView([])) is False
    with pytest.raises(TypeError):
        hash(view)


def _engine(model_dir, core_process: bool) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", block_size=4,
                                kv_cache_memory_bytes=16 << 20, seed=0),
                     core_process=core_process)


@pytest.mark.parametrize("core_process", [False, True], ids=["inproc", "process"])
def test_step_outputs_never_change_after_later_steps(tiny_llama, core_process):
    engine = _engine(tiny_llama, core_process)
    try:
        prompt = {"prompt_token_ids": [5, 17, 33, 48, 60, 71, 99, 120]}
        engine.add_request("one", prompt, SamplingParams(max_tokens=9, temperature=0.0,
                                                         ignore_eos=True, logprobs=2))
        engine.add_request("two", prompt, SamplingParams(n=2, max_tokens=7, temperature=1.0,
                                                         seed=3, ignore_eos=True, logprobs=1))
        seen = []  # (output object, what it held when it came, read without a copy)
        while engine.has_unfinished_requests():
            for out in engine.step():
                held = [(c.text, list(c.token_ids_view), list(c.logprobs_view),
                         c.cumulative_logprob, c.finish_reason) for c in out.outputs]
                seen.append((out, held))
        final = {out.request_id: out for out, _ in seen if out.finished}
        assert set(final) == {"one", "two"}
        assert [c.num_tokens for c in final["one"].outputs] == [9]
        assert [len(c.token_ids) for c in final["two"].outputs] == [7, 7]
        lengths = {}
        for out, held in seen:  # read after every step ran: unchanged by the later steps
            now = [(c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason)
                   for c in out.outputs]
            assert now == held
            for c, last in zip(out.outputs, final[out.request_id].outputs, strict=True):
                assert type(c.token_ids) is list and type(c.logprobs) is list
                json.dumps(c.token_ids)
                n = c.num_tokens
                assert n >= lengths.get((out.request_id, c.index), 0)
                lengths[out.request_id, c.index] = n
                assert c.token_ids == last.token_ids[:n] and c.logprobs == last.logprobs[:n]
                assert last.text.startswith(c.text)
                assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True))
        engine.check_invariants()
    finally:
        engine.shutdown()


def test_completion_output_reads_views_as_lists():
    ids, lps = [1, 2, 3], [{1: -0.5}, {2: -0.25}, {3: -1.0}]
    c = CompletionOutput(0, "abc", PrefixView(ids, 2), -0.75, PrefixView(lps, 2), None, None)
    ids.append(4)
    assert c.num_tokens == 2 and c.token_ids_view == [1, 2]
    assert c.token_ids == [1, 2] and type(c.token_ids) is list and c.token_ids is c.token_ids
    assert c.logprobs == [{1: -0.5}, {2: -0.25}] and type(c.logprobs) is list
    c.token_ids.append(9)  # a caller's own list now: the engine's is untouched
    assert ids == [1, 2, 3, 4]
    blank = dataclasses.replace(c, text="", token_ids=[])
    assert (blank.text, blank.token_ids, blank.logprobs, c.text) == ("", [], c.logprobs, "abc")
    assert CompletionOutput(1, "x", [5]) == CompletionOutput(1, "x", PrefixView([5, 6], 1))
    assert CompletionOutput(1, "x", [5]) != CompletionOutput(1, "x", [6])
    assert repr(CompletionOutput(0, "x", PrefixView([5, 6], 1))).startswith(
        "CompletionOutput(index=0, text='x', token_ids=[5],")
    assert CompletionOutput(0).token_ids == [] and CompletionOutput(0).logprobs is None
    c = CompletionOutput(0, "ab", PrefixView([5, 6, 7], 2), None, None, "stop", None)
    assert dataclasses.asdict(c) == {"index": 0, "text": "ab", "token_ids": [5, 6],
                                     "cumulative_logprob": None, "logprobs": None,
                                     "finish_reason": "stop", "stop_reason": None}
    assert pickle.loads(pickle.dumps(c)) == c
