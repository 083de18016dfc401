"""Which positions of a step get logits: the last of each sampling request, plus the leading
prompt-logprob positions of the chunks that asked for them."""

from __future__ import annotations

from pagedkv.model.logits_rows import select_logits_rows
from pagedkv.sched.output import ScheduledRequest
from pagedkv.sched.sampling_params import SamplingParams


def req(rid, tokens, start, samples, rows=0, prompt=None):
    return ScheduledRequest(rid, tokens, start, [1, 2, 3, 4], SamplingParams(), samples,
                            prompt_token_ids=prompt or [], num_prompt_logprob_rows=rows)


def test_only_sampling_rows_without_prompt_logprobs():
    sel = select_logits_rows([req("a", [1], 5, 1), req("b", [1, 2, 3], 0, 0),
                              req("c", [4, 5], 3, 1)])
    assert sel.positions == [0, 5]
    assert [r.request_id for r in sel.samplers] == ["a", "c"] and sel.sample_rows == [0, 1]
    assert sel.prompt_rows == []


def test_prompt_logprob_rows_and_their_targets():
    prompt = [10, 11, 12, 13, 14, 15]
    middle = req("p", prompt[2:4], 2, 0, rows=2, prompt=prompt)      # chunk 2..3, no sample
    last = req("q", prompt[4:], 4, 1, rows=1, prompt=prompt)         # chunk 4..5, samples
    sel = select_logits_rows([req("d", [9], 7, 1), middle, last])
    # d's row, then p's positions 1, 2 (chunk-local 0, 1), then q's position 3 and its last.
    assert sel.positions == [0, 1, 2, 3, 4]
    assert [(r.request.request_id, r.first_row, r.count) for r in sel.prompt_rows] == [
        ("p", 1, 2), ("q", 3, 1)]
    assert sel.prompt_rows[0].target_ids == [13, 14]
    assert sel.prompt_rows[1].target_ids == [15]
    assert sel.sample_rows == [0, 4]
