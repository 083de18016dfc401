"""OutputProcessor: the frontend's half of a step. Turns the core's per-sample news
(`CoreOutput`: new tokens, logprobs, finish) into vLLM's cumulative `RequestOutput`s:
incremental detokenization, stop strings, and the grouping of an `n > 1` request's samples.

Per sample and step it costs O(new tokens): the `RequestOutput`s it returns stay valid and
unchanged after later steps without copying anything, as their token and logprob lists are
`PrefixView`s of the sample's lists, which only ever grow (text is an immutable `str`); a
consumer that reads `token_ids` gets a list made then (see `CompletionOutput`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedkv.config.errors import ErrorKind
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.messages import CoreOutput
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.prefix_view import PrefixView
from pagedkv.sched.sampling_params import SamplingParams


class _Sample:
    """One sample's live state: its growing token and logprob lists (appended to only: the
    outputs already returned hold views of them), text, finish and detokenizer."""

    __slots__ = ("index", "token_ids", "logprobs", "cumulative_logprob", "text",
                 "finish_reason", "stop_reason", "detokenizer")

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, logprobs: bool) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if logprobs else None
        self.cumulative_logprob: float | None = 0.0 if logprobs else None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = detokenizer

    def add_logprobs(self, new_tokens: list[int], new_logprobs: list[dict[int, float]]) -> None:
        """Append the new tokens' logprobs and add them to the cumulative sum (mutates self)."""
        self.logprobs.extend(new_logprobs)
        total = self.cumulative_logprob
        for token, entry in zip(new_tokens, new_logprobs, strict=False):
            total += entry.get(token, 0.0)
        self.cumulative_logprob = total

    def output(self) -> CompletionOutput:
        """What the caller may keep (O(1)): views of the lists at their current lengths."""
        logprobs = self.logprobs
        return CompletionOutput(self.index, self.text, PrefixView(self.token_ids),
                                self.cumulative_logprob,
                                None if logprobs is None else PrefixView(logprobs),
                                self.finish_reason, self.stop_reason)


@dataclass
class _Group:
    """One user request: sample 0 is the request itself, samples 1..n-1 its forked children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: dict[int, _Sample] = field(default_factory=dict)
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: ErrorKind | None = None
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
        first = self.samples.get(0)
        if first is None or first.finish_reason is None:
            return False
        if not first.token_ids and len(self.samples) == 1:
            return True
        return self.num_finished == self.params.n

    def output(self) -> RequestOutput:
        """A snapshot of the group's outputs so far, in O(samples): views of the samples'
        lists (which only grow), never copies."""
        samples = self.samples
        if len(samples) == 1:
            (only,) = samples.values()
            outputs = [only.output()]
        else:
            outputs = [samples[i].output() for i in sorted(samples)]
        metrics = self.metrics
        if metrics is None:
            metrics = self.metrics = {
                "arrival_time": self.arrival_time, "first_token_time": self.first_token_time or 0.0,
                "first_scheduled_time": self.first_scheduled_time or 0.0,
                "num_preemptions": float(self.num_preemptions)}
        finished = self.num_finished > 0 and self.finished  # (no sample ended: running on)
        if finished:  # when the last token came: the request log's engine_last_token
            metrics = {**metrics, "last_token_time": self.last_token_time or 0.0}
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished, self.num_cached_tokens, self.error, metrics,
                             self.prompt_logprobs, self.error_kind)


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
        """Apply one sample's news to its live state (mutated); the stop string that ended it
        here, if any. O(new tokens)."""
        index = out.sample_index
        sample = group.samples.get(index)
        if sample is None:
            sample = self._add_sample(group, index)
        elif sample.finish_reason is not None:  # ended here by a stop string already
            return None
        group.num_cached_tokens = out.num_cached_tokens
        if (out.num_preemptions > group.num_preemptions or out.first_scheduled_time is not None
                or out.prompt_logprobs is not None or out.error is not None):
            _apply_request_news(group, out)
        new_tokens = out.new_token_ids
        detokenizer = sample.detokenizer
        finish_reason = out.finish_reason
        stop = None
        if new_tokens:
            if group.first_token_time is None:
                group.first_token_time = now
                group.metrics = None
            group.last_token_time = now
            # A stop token (eos, stop_token_ids) ends it: its text is left out, as in vLLM.
            stop_terminated = finish_reason == "stop" and not isinstance(out.stop_reason, str)
            if len(new_tokens) > 1 and detokenizer.stop:  # a speculative run: cut at the stop
                new_tokens, stop = _update_until_stop(detokenizer, new_tokens, stop_terminated)
            else:
                stop = detokenizer.update(new_tokens, stop_terminated)
            sample.token_ids += new_tokens
            if sample.logprobs is not None and out.new_logprobs:
                sample.add_logprobs(new_tokens, out.new_logprobs[:len(new_tokens)])
        if finish_reason is None and stop is None:  # the usual step: it runs on
            sample.text = detokenizer.text
            return None
        stop_reason = out.stop_reason
        if stop is not None and finish_reason is None:
            finish_reason, stop_reason = "stop", stop
        else:
            stop = None  # the core finished it already (eos, length, ...)
        # (nothing held back is flushed: vLLM leaves an unfinished window out)
        sample.finish_reason = finish_reason
        sample.stop_reason = stop_reason
        group.num_finished += 1
        sample.text = detokenizer.text
        return stop

    def _add_sample(self, group: _Group, index: int) -> _Sample:
        """Sample `index`'s first output: its live state (added to `group`)."""
        params = group.params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, group.prompt_token_ids, params.stop_strings,
            params.skip_special_tokens, params.include_stop_str_in_output, params.min_tokens,
            params.spaces_between_special_tokens)
        sample = group.samples[index] = _Sample(index, detokenizer, params.logprobs is not None)
        return sample


def _apply_request_news(group: _Group, out: CoreOutput) -> None:
    """The request-wide facts a sample's output may bring (preemptions, first schedule,
    prompt logprobs, an error and its kind): set on `group` (its shared metrics dropped when they change)."""
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
        group.error_kind = out.error_kind


def _update_until_stop(detokenizer: IncrementalDetokenizer, new_tokens: list[int],
                       stop_terminated: bool) -> tuple[list[int], str | None]:
    """Feed `new_tokens` (several: a verified speculative run) one at a time; the tokens up to
    the one that completes a stop string (all of them when none does) and that string."""
    last = len(new_tokens) - 1
    for i, token_id in enumerate(new_tokens):
        stop = detokenizer.update([token_id], stop_terminated and i == last)
        if stop is not None:
            return new_tokens[:i + 1], stop
    return new_tokens, None
