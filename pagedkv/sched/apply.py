"""The apply side of the scheduler: a step's sampled tokens written into its requests.

`update()` advances each scheduled request's `num_computed_tokens`, caches the blocks a step
filled, appends the sampled token (and its logprobs; the structured-output grammar accepts
it), forks the children of an `n > 1` request at its first sample (each shares the parent's
blocks, kv.fork), and finishes the requests that hit eos / stop tokens / `max_tokens` /
`max_model_len` or whose grammar ended or failed. Stop *strings* need text, so the engine
finishes those through `Scheduler.finish_requests()`. Also here: the tokens a request's next
sample must not be (`banned_token_ids`: eos and stop tokens below `min_tokens`, bad words).
A beam-search request's sample goes to its beam group instead (beam.py), which picks the
beams' tokens once all of them sampled.
"""

from __future__ import annotations

from dataclasses import replace

from pagedkv.kv.interface import KVCacheManagerAPI
from pagedkv.sched.beam import BeamSearch
from pagedkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedkv.sched.request import Request, RequestStatus, child_request_id


def bad_word_bans(request: Request) -> list[int]:
    """Tokens that would complete one of the request's bad words now: the last token of each
    bad word whose other tokens end the output so far (vLLM's rule)."""
    out = request.output_token_ids
    bans = []
    for word in request.bad_words_token_ids:
        n = len(word) - 1  # the prefix; its last token is compared first (cheap reject)
        if n == 0 or (n <= len(out) and out[-1] == word[-2]
                      and out[len(out) - n:] == word[:-1]):
            bans.append(word[-1])
    return bans


def banned_token_ids(request: Request, num_outputs: int) -> tuple[int, ...]:
    """Tokens the request must not sample as its output number `num_outputs`: eos and stop
    tokens below `min_tokens`, and the last token of a bad word its output would end."""
    params = request.sampling_params
    banned: tuple[int, ...] = ()
    if num_outputs < params.min_tokens:
        eos = () if params.ignore_eos else request.eos_token_ids
        banned = (*eos, *params.stop_token_ids)
    if request.bad_words_token_ids:
        banned = (*banned, *bad_word_bans(request))
    return banned


class ApplyMixin:
    """Scheduler.update and what it calls (see the module docstring); `config` (its
    max_model_len), the queues, `_finish` and `_enqueue` are the Scheduler's (scheduler.py)."""

    kv_cache_manager: KVCacheManagerAPI
    block_size: int
    requests: dict[str, Request]
    running: list[Request]
    ended_in_schedule: list[Request]
    proposer: object | None  # speculation.py's; None without speculative decoding
    _unapplied: list[tuple[SchedulerOutput, set[bytes]]]
    beams: BeamSearch

    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Apply a step's results. Returns the requests that got tokens or finished (children
        of `n > 1` requests included), in schedule order."""
        changed: list[Request] = list(self.ended_in_schedule)
        self.ended_in_schedule = []
        self._unapplied = [u for u in self._unapplied if u[0] is not out]
        kv = self.kv_cache_manager
        caching, bs = kv.enable_caching, self.block_size
        sampled, logprobs_of = result.sampled_token_ids, result.logprobs
        prompt_logprobs_of = result.prompt_logprobs
        requests = self.requests
        for scheduled in out.scheduled:
            request = requests.get(scheduled.request_id)
            if request is None:  # ended while it ran
                continue
            slots = request.scheduled_slots  # (`_owns`, inlined: once per request per step)
            if slots[0] is not scheduled and slots[1] is not scheduled:
                continue  # an ended request's, whose id a new request took
            if scheduled.spec_token_ids:  # verified draft tokens (speculation.py)
                self.apply_verified(request, scheduled, sampled[request.request_id],
                                    logprobs_of.get(request.request_id))
                changed.append(request)
                continue
            num_new = len(scheduled.token_ids)
            request.num_tokens_ahead -= num_new
            computed = request.num_computed_tokens + num_new
            request.num_computed_tokens = computed
            # Only a step that fills a block has a block to cache (the ones before were
            # cached by the step that filled them): most decode steps skip the call.
            if caching and (computed - num_new) // bs != computed // bs:
                kv.cache_blocks(request, computed)
            if prompt_logprobs_of:
                prompt_logprobs = prompt_logprobs_of.get(request.request_id)
                if prompt_logprobs is not None:  # a recompute overwrites what it computes again
                    del request.prompt_logprobs[scheduled.start_pos:]
                    request.prompt_logprobs.extend(prompt_logprobs)
            if scheduled.num_samples == 0:
                continue
            request.num_placeholders -= 1
            grammar = request.structured_output
            if grammar is not None and grammar.is_terminated():  # complete: no more tokens
                self._finish(request, RequestStatus.FINISHED_STOPPED, None)
                changed.append(request)
                continue
            tokens = sampled[request.request_id]
            if len(tokens) == 1 and grammar is None and not logprobs_of:  # the usual case
                request.append_output_token(tokens[0])
                changed.append(request)
                self._check_stop(request)
                continue
            logprobs = logprobs_of.get(request.request_id)
            if request.sampling_params.use_beam_search:  # its group picks the token (beam.py)
                self.beams.on_sample(request, logprobs[0])
                continue
            if len(tokens) == 1:  # no children to fork
                self._append_token(request, tokens[0], logprobs[0] if logprobs else None)
                changed.append(request)
                self._check_stop(request)
                continue
            children = self._fork_children(request, tokens[1:], logprobs)
            self._append_token(request, tokens[0], logprobs[0] if logprobs else None)
            for req in (request, *children):
                changed.append(req)
                self._check_stop(req)
        if self.beams.groups:
            changed += self.beams.advance(stalled=not out.scheduled)
        if self.proposer is not None:
            self.propose_drafts(changed)
        return changed

    def _append_token(self, request: Request, token_id: int,
                      logprobs: dict[int, float] | None) -> None:
        request.append_output_token(token_id)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        grammar = request.structured_output
        if grammar is not None and not grammar.accept_token(token_id):
            # The sampler masks forbidden tokens, so the grammar engine failed (`error`) or left
            # nothing allowed: `_check_stop` ends this request alone.
            request.error = grammar.error or (
                f"token {token_id} violates the request's structured-output grammar (the "
                "grammar allowed no token: is it satisfiable, with this vocabulary?)")

    def _fork_children(self, parent: Request, tokens: list[int],
                       logprobs: list[dict[int, float]] | None) -> list[Request]:
        children = []
        for i, token_id in enumerate(tokens, start=1):
            child = Request(
                request_id=child_request_id(parent.request_id, i),
                prompt_token_ids=parent.prompt_token_ids,
                sampling_params=replace(parent.sampling_params),
                eos_token_ids=parent.eos_token_ids,
                arrival_time=parent.arrival_time,
                priority=parent.priority,
                cache_salt=parent.cache_salt,
                lora_name=parent.lora_name,
                parent_id=parent.request_id,
                sample_index=i,
            )
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            child.bad_words_token_ids = parent.bad_words_token_ids
            if parent.structured_output is not None:  # forked before the parent's own token
                child.structured_output = parent.structured_output.fork()
            self.kv_cache_manager.fork(parent, child)
            self._append_token(child, token_id, logprobs[i] if logprobs else None)
            self.requests[child.request_id] = child
            self._enqueue(self.running, child)
            children.append(child)
        return children

    def _check_stop(self, request: Request) -> None:
        """Finish `request` if its last token ends it (`_stop_status`)."""
        stop = self._stop_status(request)
        if stop is not None:
            self._finish(request, *stop)

    def _stop_status(self, request: Request) -> tuple[RequestStatus, int | str | None] | None:
        """(status, reason) the request ends with after its last token, None when it runs on:
        a grammar error or its end, eos / a stop token past `min_tokens`, `max_tokens`,
        `max_model_len`. Reads only."""
        params = request.sampling_params
        outputs = request.output_token_ids
        token_id = outputs[-1]
        grammar = request.structured_output
        if grammar is not None and request.error is not None:
            return RequestStatus.FINISHED_ERROR, request.error
        if grammar is not None and grammar.is_terminated():
            return (RequestStatus.FINISHED_STOPPED,
                    token_id if token_id in params.stop_token_ids else None)
        if len(outputs) >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        if ((params.max_tokens is not None and len(outputs) >= params.max_tokens)
                or len(request.all_token_ids) >= self.config.max_model_len):
            return RequestStatus.FINISHED_LENGTH, None
        return None
