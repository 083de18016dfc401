"""OutputProcessor: the frontend's half of a step. Turns the core's per-sample news
(`CoreOutput`: new tokens, logprobs, finish) into vLLM's cumulative `RequestOutput`s:
incremental detokenization, stop strings, and the grouping of an `n > 1` request's samples.

Per sample and step it costs O(new tokens) plus one snapshot of the sample's lists on the way
out (`RequestOutput`s stay valid and unchanged after later steps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.messages import CoreOutput
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.sched.sampling_params import SamplingParams


@dataclass
class _Group:
    """One user request: sample 0 is the request itself, samples 1..n-1 its forked children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0
    error: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0  # the most any of its samples was preempted
    prompt_logprobs: list[dict[int, float] | None] | None = None  # replaced, never mutated
    num_finished: int = 0
    # The outputs' metrics while none of their values changes (shared: never mutated).
    metrics: dict[str, float] | None = None

    @property
    def finished(self) -> bool:
        # Children are forked together with the first sampled token; a request that ends with
        # no token (error, abort) never gets them.
        first = self.completions.get(0)
        if first is None or first.finish_reason is None:
            return False
        if not first.token_ids and len(self.completions) == 1:
            return True
        return self.num_finished == self.params.n

    def output(self) -> RequestOutput:
        """A snapshot of the group's outputs so far (its lists copied or never mutated)."""
        completions = self.completions
        if len(completions) == 1:
            (only,) = completions.values()
            outputs = [_snapshot(only)]
        else:
            outputs = [_snapshot(completions[i]) for i in sorted(completions)]
        metrics = self.metrics
        if metrics is None:
            metrics = self.metrics = {
                "arrival_time": self.arrival_time, "first_token_time": self.first_token_time or 0.0,
                "first_scheduled_time": self.first_scheduled_time or 0.0,
                "num_preemptions": float(self.num_preemptions)}
        if self.finished:  # when the last token came: the request log's engine_last_token
            metrics = {**metrics, "last_token_time": self.last_token_time or 0.0}
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             self.finished, self.num_cached_tokens, self.error, metrics,
                             self.prompt_logprobs)


def _add_logprobs(completion: CompletionOutput, new_tokens: list[int],
                  new_logprobs: list[dict[int, float]]) -> None:
    """Append the new tokens' logprobs to `completion` and add them to its cumulative sum."""
    completion.logprobs.extend(new_logprobs)
    total = completion.cumulative_logprob
    for token, entry in zip(new_tokens, new_logprobs, strict=False):
        total += entry.get(token, 0.0)
    completion.cumulative_logprob = total


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    """A copy the caller may keep: the processor goes on appending to `c`'s lists (a list copy
    is one memcpy: the only O(tokens so far) work per step, and far below a token's other
    costs at any length a request reaches)."""
    logprobs = c.logprobs
    return CompletionOutput(c.index, c.text, c.token_ids[:], c.cumulative_logprob,
                            None if logprobs is None else logprobs[:],
                            c.finish_reason, c.stop_reason)


class OutputProcessor:
    """Holds the live request groups of one engine; see the module docstring. Not thread-safe:
    the thread that steps the engine owns it."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001 - pagedkv.model.tokenizer.Tokenizer
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}

    def add_group(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                  params: SamplingParams, arrival_time: float) -> None:
        self.groups[request_id] = _Group(request_id, prompt, prompt_token_ids, params,
                                         arrival_time)

    def pop_group(self, request_id: str) -> _Group | None:
        return self.groups.pop(request_id, None)

    def process(self, core_outputs: list[CoreOutput], now: float | None = None
                ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Apply one step's core outputs. Returns the cumulative output of each group that
        progressed (finished groups are forgotten after it) and the (sample id, stop string)
        of the samples a stop string ended, which the core must finish ("stop"). `now`: when
        the step ended (time.monotonic(); default: now), the requests' token times."""
        if now is None:
            now = time.monotonic()
        touched: dict[str, _Group] = {}
        stops: list[tuple[str, str]] = []
        groups = self.groups
        for out in core_outputs:
            group_id = out.parent_id or out.request_id
            group = groups.get(group_id)
            if group is None:
                continue
            touched[group_id] = group
            stop = self._apply(group, out, now)
            if stop is not None:
                stops.append((out.request_id, stop))
        outputs = []
        for group_id, group in touched.items():
            output = group.output()
            outputs.append(output)
            if output.finished:
                del groups[group_id]
        return outputs, stops

    def _apply(self, group: _Group, out: CoreOutput, now: float) -> str | None:
        index = out.sample_index
        completion = group.completions.get(index)
        if completion is None:
            completion = group.completions[index] = CompletionOutput(index=index)
            params = group.params
            group.detokenizers[index] = IncrementalDetokenizer(
                self.tokenizer, group.prompt_token_ids, params.stop_strings,
                params.skip_special_tokens, params.include_stop_str_in_output)
            if params.logprobs is not None:
                completion.logprobs = []
                completion.cumulative_logprob = 0.0
        elif completion.finish_reason is not None:  # ended here by a stop string already
            return None
        group.num_cached_tokens = out.num_cached_tokens
        if out.num_preemptions > group.num_preemptions:
            group.num_preemptions = out.num_preemptions
            group.metrics = None
        if out.first_scheduled_time is not None and group.first_scheduled_time is None:
            group.first_scheduled_time = out.first_scheduled_time
            group.metrics = None
        if out.prompt_logprobs is not None:
            group.prompt_logprobs = [None, *out.prompt_logprobs]
        if out.error is not None:
            group.error = out.error
        new_tokens = out.new_token_ids
        detokenizer = group.detokenizers[index]
        stop = None
        if new_tokens:
            if group.first_token_time is None:
                group.first_token_time = now
                group.metrics = None
            group.last_token_time = now
            completion.token_ids += new_tokens
            if completion.logprobs is not None and out.new_logprobs:
                _add_logprobs(completion, new_tokens, out.new_logprobs)
            stop = detokenizer.update(new_tokens)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if stop is not None and finish_reason is None:
            finish_reason, stop_reason = "stop", stop
        else:
            stop = None  # the core finished it already (eos, length, ...)
        if finish_reason is not None:
            detokenizer.flush()
            completion.finish_reason = finish_reason
            completion.stop_reason = stop_reason
            group.num_finished += 1
        completion.text = detokenizer.text
        return stop
