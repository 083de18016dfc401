"""Beam search in the scheduler: a request with `use_beam_search` runs as a group of beams, each
an ordinary Request whose KV blocks the others share by reference count.

The request itself is the first beam (under an internal id, `<id>#beam0`; forks are
`<id>#beam<k>`). Every step each live beam samples once, greedily, with
its top K = (1 + number of eos ids) * width logprobs (the sampler's usual top-N); `update()`
hands them here (`on_sample`) instead of appending a token. When every live beam has its
logprobs, `advance()` takes the K best continuations of all beams together (cumulative
logprob), keeps the `width` best that did not end as the next beams, and files the ones among
the `width` best that ended (eos, `max_tokens`, `max_model_len`) as finished hypotheses,
scored cumulative logprob / generated length ** length_penalty (transformers' `generate(
num_beams=W)` exactly: its finished-hypothesis list, its early-stop heuristic and its
`early_stopping` True / False / "never").

A kept beam's first continuation reuses its Request (one token appended); each further one is a
fork: `kv_cache_manager.fork(parent, child)` shares every block of the parent, and the
allocation's copy-on-write copies only the partly filled last block the two then write
different tokens into. A beam no continuation kept is finished at once: the manager frees its
own blocks and drops its reference to the shared ones. A beam that was preempted meanwhile
(recompute or swap) keeps no device blocks to share: its forks recompute (the prefix cache
serves what is cached). Should such a beam never fit again (nothing else can run: the step
was empty), the group goes on with the beams that sampled. When the search ends, the `width` best hypotheses come back as the
request's samples 0..width-1, best first (`Request`s built for reporting only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pagedkv.kv.interface import KVCacheManagerAPI
from pagedkv.sched.request import Request, RequestStatus, child_request_id
from pagedkv.sched.sampling_params import SamplingParams


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty (transformers' and vLLM's score), defined for
    every penalty: a denominator past the float range gives 0, one that underflows -inf."""
    try:
        denominator = float(max(length, 1)) ** length_penalty
    except OverflowError:
        return 0.0 * cum_logprob
    if denominator == 0.0:
        return -math.inf if cum_logprob < 0 else 0.0
    return cum_logprob / denominator


class BeamHost(Protocol):
    """What the beam groups use of the Scheduler (scheduler.py): its queues, the KV manager,
    `config.max_model_len`, and how it ends and queues a request."""

    config: Any
    kv_cache_manager: KVCacheManagerAPI
    requests: dict[str, Request]
    running: list[Request]
    waiting: list[Request]

    def _finish(self, request: Request, status: RequestStatus,
                reason: int | str | None = None) -> None: ...

    def _enqueue(self, queue: list[Request], request: Request) -> None: ...


@dataclass
class Hypothesis:
    """A finished sequence: its output tokens, their logprob tables, cumulative logprob and
    score (cumulative / length ** length_penalty)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float
    score: float
    finish: RequestStatus


@dataclass
class Candidate:
    """A beam's continuation by one token."""

    cum_logprob: float
    parent: int  # index into the group's live beams
    token_id: int
    logprob_table: dict[int, float]


@dataclass
class BeamGroup:
    """One beam-search request's state (see the module docstring)."""

    request_id: str  # the request's own id: its samples are reported under it
    root: Request  # the first beam (renamed `<id>#beam0`)
    width: int
    eos_token_ids: frozenset[int]
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    max_len: int  # max_model_len: no beam grows past it
    user_params: SamplingParams  # the request's own (its samples are reported with them)
    beams: list[Request] = field(default_factory=list)
    cum_logprobs: list[float] = field(default_factory=list)
    pending: dict[str, dict[int, float]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True  # transformers' early-stop heuristic not yet satisfied
    num_forks: int = 0

    @property
    def num_candidates(self) -> int:
        return (1 + len(self.eos_token_ids)) * self.width

    def ready(self) -> bool:
        return all(beam.request_id in self.pending for beam in self.beams)

    def candidates(self) -> list[Candidate]:
        """The K best one-token continuations of all live beams, best first."""
        found = []
        k = self.num_candidates
        for index, beam in enumerate(self.beams):
            table = self.pending[beam.request_id]
            best = sorted(table.items(), key=lambda item: -item[1])[:k]
            found += [Candidate(self.cum_logprobs[index] + lp, index, token, table)
                      for token, lp in best]
        found.sort(key=lambda c: -c.cum_logprob)  # stable: ties keep beam then rank order
        return found[:k]

    def ends(self, candidate: Candidate, length: int) -> bool:
        """Whether the continuation ends its sequence (`length`: its output length)."""
        return (candidate.token_id in self.eos_token_ids or length >= self.max_tokens
                or self.root.num_prompt_tokens + length >= self.max_len)

    def score(self, cum_logprob: float, length: int) -> float:
        return beam_score(cum_logprob, length, self.length_penalty)

    def file_finished(self, top: list[Candidate], length: int) -> None:
        """transformers' `_update_finished_beams`: the continuations among the `width` best
        that end join the finished hypotheses (the `width` best are kept), unless the search
        cannot improve any more or is full with early_stopping True."""
        if not self.improvable or (self.early_stopping is True
                                   and len(self.finished) >= self.width):
            return
        for cand in top:
            if not self.ends(cand, length):
                continue
            beam = self.beams[cand.parent]
            status = (RequestStatus.FINISHED_STOPPED if cand.token_id in self.eos_token_ids
                      else RequestStatus.FINISHED_LENGTH)
            self.finished.append(Hypothesis(
                [*beam.output_token_ids, cand.token_id],
                [*beam.output_logprobs, cand.logprob_table], cand.cum_logprob,
                self.score(cand.cum_logprob, length), status))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width:]

    def still_improvable(self, best_running: float, length: int) -> bool:
        """transformers' `_check_early_stop_heuristic` after a step to `length` tokens."""
        if not self.improvable or len(self.finished) < self.width:
            return self.improvable
        hypothetical = (self.max_tokens if self.early_stopping == "never"
                        and self.length_penalty > 0 else length)
        best = self.score(best_running, hypothetical)
        return best > min(h.score for h in self.finished)


class BeamSearch:
    """The scheduler's beam groups, by root request id (`scheduler.beams`)."""

    def __init__(self, scheduler: BeamHost) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, BeamGroup] = {}
        self._group_of: dict[str, BeamGroup] = {}  # live beam id -> its group

    def add(self, request: Request) -> None:
        """Start a group whose first beam is `request` (just queued by the scheduler; renamed
        `<id>#beam0`): it samples one token per step with the logprobs the selection needs."""
        params = request.sampling_params
        eos = frozenset(() if params.ignore_eos else request.eos_token_ids)
        request_id = request.request_id
        self._rename(request, f"{request_id}#beam0")
        group = BeamGroup(request_id, request, params.n, eos, params.length_penalty, params.early_stopping,
                          params.max_tokens, self.scheduler.config.max_model_len, params,
                          beams=[request], cum_logprobs=[0.0])
        internal = replace(params, n=1)
        internal.logprobs = group.num_candidates  # (may pass SamplingParams' cap of 20)
        request.sampling_params = internal
        self.groups[request_id] = group
        self._group_of[request.request_id] = group

    def _rename(self, request: Request, request_id: str) -> None:
        """Give a just queued request (no blocks yet) an internal id: the request's own id is
        reported only with the search's result, so a beam's own finish never reaches the
        frontend as the request's."""
        scheduler = self.scheduler
        scheduler.waiting.remove(request)
        del scheduler.requests[request.request_id]
        request.request_id = request_id
        scheduler.requests[request_id] = request
        scheduler._enqueue(scheduler.waiting, request)

    def with_beams(self, request_ids: list[str]) -> list[str]:
        """`request_ids` with the live beams of the groups they name (an abort of a beam-search
        request ends all its beams); those groups are forgotten."""
        extra = []
        for request_id in request_ids:
            group = self.groups.pop(request_id, None)
            if group is not None:
                extra += [b.request_id for b in group.beams]
                for beam in group.beams:
                    self._group_of.pop(beam.request_id, None)
        return [*request_ids, *extra]

    def on_sample(self, request: Request, logprobs: dict[int, float]) -> None:
        """A beam's logprob table for its next token (the token is chosen in `advance`)."""
        group = self._group_of.get(request.request_id)
        if group is not None:
            group.pending[request.request_id] = logprobs

    def advance(self, stalled: bool = False) -> list[Request]:
        """Step every group whose beams all sampled; the finished groups' samples (Requests
        for reporting, best first) and any that ended otherwise. `stalled`: the step ran
        nothing, so a beam waiting to be readmitted may never fit (recomputed beams no longer
        share blocks): a group with sampled beams then goes on without the others."""
        reported: list[Request] = []
        for group in list(self.groups.values()):
            if any(beam.is_finished for beam in group.beams):
                reported += self._end_failed(group)
            elif group.ready():
                reported += self._step(group)
            elif stalled and group.pending:
                self._drop_unsampled(group)
                reported += self._step(group)
        return reported

    def _drop_unsampled(self, group: BeamGroup) -> None:
        """Free the group's beams that have not sampled this round (see `advance`)."""
        kept = [i for i, beam in enumerate(group.beams) if beam.request_id in group.pending]
        for i, beam in enumerate(group.beams):
            if i not in kept:
                self._group_of.pop(beam.request_id, None)
                self.scheduler._finish(beam, RequestStatus.FINISHED_ABORTED, None)
        group.beams = [group.beams[i] for i in kept]
        group.cum_logprobs = [group.cum_logprobs[i] for i in kept]

    def _step(self, group: BeamGroup) -> list[Request]:
        length = group.beams[0].num_output_tokens + 1
        top = group.candidates()
        group.pending.clear()
        group.file_finished(top[:group.width], length)
        running = [c for c in top if not group.ends(c, length)][:group.width]
        if running:
            group.improvable = group.still_improvable(running[0].cum_logprob, length)
        done = (not running or not group.improvable
                or (group.early_stopping is True and len(group.finished) >= group.width))
        if done:
            return self._finish_group(group)
        self._reassign(group, running)
        return []

    def _reassign(self, group: BeamGroup, running: list[Candidate]) -> None:
        """Make `running` the live beams: a parent's first continuation reuses it, the others
        fork it; parents with none are finished (their own blocks freed)."""
        old = group.beams
        by_parent: dict[int, list[Candidate]] = {}
        for cand in running:
            by_parent.setdefault(cand.parent, []).append(cand)
        scheduler = self.scheduler
        for index, beam in enumerate(old):
            if index not in by_parent:
                self._group_of.pop(beam.request_id, None)
                scheduler._finish(beam, RequestStatus.FINISHED_ABORTED, None)
        new_beams: list[Request] = []
        new_cums: list[float] = []
        for index, cands in by_parent.items():
            parent = old[index]
            children = [self._fork(group, parent) for _ in cands[1:]]
            for beam, cand in zip((parent, *children), cands, strict=True):
                beam.append_output_token(cand.token_id)
                beam.output_logprobs.append(cand.logprob_table)
                new_beams.append(beam)
                new_cums.append(cand.cum_logprob)
        order = sorted(range(len(new_beams)), key=lambda i: -new_cums[i])
        group.beams = [new_beams[i] for i in order]
        group.cum_logprobs = [new_cums[i] for i in order]

    def _fork(self, group: BeamGroup, parent: Request) -> Request:
        """A new beam equal to `parent` so far; it shares the parent's device blocks when the
        parent holds them, else it is queued to recompute."""
        scheduler = self.scheduler
        group.num_forks += 1
        child = Request(
            request_id=f"{group.request_id}#beam{group.num_forks}",
            prompt_token_ids=parent.prompt_token_ids, sampling_params=parent.sampling_params,
            eos_token_ids=parent.eos_token_ids, arrival_time=parent.arrival_time,
            priority=parent.priority, cache_salt=parent.cache_salt, lora_name=parent.lora_name)
        child.output_token_ids = list(parent.output_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        child.output_logprobs = list(parent.output_logprobs)
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        if parent.status == RequestStatus.RUNNING:
            scheduler.kv_cache_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            queue = scheduler.running
        else:  # preempted (recompute) or swapped out: nothing on the device to share
            child.status = RequestStatus.PREEMPTED
            queue = scheduler.waiting
        scheduler.requests[child.request_id] = child
        scheduler._enqueue(queue, child)
        self._group_of[child.request_id] = group
        return child

    def _finish_group(self, group: BeamGroup) -> list[Request]:
        """End the search: free every live beam; the best hypotheses as samples."""
        self._drop(group)
        root = group.root
        preemptions = max(beam.num_preemptions for beam in group.beams)
        samples = []
        for index, hyp in enumerate(group.finished):
            sample = Request(
                request_id=(group.request_id if index == 0
                            else child_request_id(group.request_id, index)),
                prompt_token_ids=root.prompt_token_ids, sampling_params=group.user_params,
                eos_token_ids=root.eos_token_ids, arrival_time=root.arrival_time,
                parent_id=None if index == 0 else group.request_id, sample_index=index)
            sample.output_token_ids = hyp.token_ids
            sample.output_logprobs = hyp.logprobs
            sample.status = hyp.finish
            sample.num_cached_tokens = root.num_cached_tokens
            sample.num_preemptions = preemptions
            sample.first_scheduled_time = root.first_scheduled_time
            samples.append(sample)
        return samples

    def _drop(self, group: BeamGroup) -> None:
        self.groups.pop(group.request_id, None)
        for beam in group.beams:
            self._group_of.pop(beam.request_id, None)
            if not beam.is_finished:
                self.scheduler._finish(beam, RequestStatus.FINISHED_ABORTED, None)

    def _end_failed(self, group: BeamGroup) -> list[Request]:
        """A beam ended otherwise (an error, or the cache can never hold it): the search ends,
        reported as the request's sample 0 with that beam's status and error (the beam itself
        was reported under its internal id, which the frontend does not know)."""
        ended = next(beam for beam in group.beams if beam.is_finished)
        self._drop(group)
        root = group.root
        sample = Request(request_id=group.request_id, prompt_token_ids=root.prompt_token_ids,
                         sampling_params=group.user_params, eos_token_ids=root.eos_token_ids,
                         arrival_time=root.arrival_time)
        sample.status = ended.status
        sample.error = ended.error
        sample.num_cached_tokens = max(root.num_cached_tokens, 0)
        return [sample]
