"""Scheduler: continuous batching over the KV cache manager.

Each `schedule()` builds one step under a token budget (`max_num_batched_tokens`) and a sequence
budget (`max_num_seqs`):

1. Running requests first, highest priority first: each gets its next tokens (a decode token or
   the next prefill chunk). When the KV cache cannot hold them, the lowest-priority, newest
   running request is preempted (by swap to host blocks, or by recompute: free and requeue),
   until the request fits or is itself the victim.
2. Swapped requests come back (swap in) before any new admission.
3. Waiting requests are admitted in priority / arrival order while the manager answers OK;
   LATER stops admission for this step; NEVER finishes that request with an error.
   With a KV store (`kv_connector`), a request whose next prompt blocks the store holds gets
   only the blocks to load them into and waits in `loading` (WAITING_FOR_REMOTE_KVS) while the
   store loads them in the background; a later step runs it from the last block loaded intact.

`update()` (apply.py) applies the runner's sampled tokens: advances `num_computed_tokens`,
caches blocks that are now computed, forks the children of `n > 1` requests, and finishes
requests that hit eos / stop tokens / `max_tokens` / `max_model_len`. Stop *strings* need
text, so the engine finishes those through `finish_requests()`.

Overlapped scheduling (vLLM's async scheduling, pagedkv/engine/overlap.py): `schedule()` may be
called again before the previous step's `update()`. A request that step runs is then scheduled
"ahead": from the end of what that step computes, with one placeholder token
(`PLACEHOLDER_TOKEN_ID`) per sample it has not returned yet, and it is never preempted (its
blocks are being written); `fill_placeholders()`, after that `update()`, writes the sampled
tokens in and drops the requests that finished meanwhile. Each request's tokens are the same
as in the serial loop: only when requests run changes, never what a request samples.
"""

from __future__ import annotations

import bisect
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from pagedkv.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagedkv.config.options import SchedulerOptions
from pagedkv.kv.interface import KVCacheManagerAPI
from pagedkv.kv.request_blocks import AllocStatus
from pagedkv.sched.apply import ApplyMixin, banned_token_ids
from pagedkv.sched.beam import BeamSearch
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.prefill_batching import PrefillBatching, resolve_mode
from pagedkv.sched.request import Request, RequestStatus
from pagedkv.sched.speculation import SpeculationMixin
from pagedkv.utils import cdiv

if TYPE_CHECKING:
    from pagedkv.spec import RequestProposer
    from pagedkv.store.connector import StoreConnectorScheduler

# A token the running step has not sampled yet (overlapped scheduling); never reaches a runner.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(kw_only=True)
class SchedulerConfig(SchedulerOptions):
    """The scheduler's budgets and policies, fixed for its lifetime: the engine's scheduler
    options (`SchedulerOptions`, declared and checked once, in pagedkv.config.options) with the
    step's token budget and the longest sequence resolved.

    `max_num_seqs`: requests running at once; `max_num_batched_tokens`: tokens per step (longer
    prompts are prefilled in chunks); `max_model_len`: the longest prompt + output a request
    may reach; `preemption_mode`: "recompute" (free the blocks, recompute later) or "swap"
    (copy them to host blocks, recompute when the host is full); `scheduling_policy` (`policy`):
    "fcfs" or "priority" (lower `priority` first, as in vLLM). Built from checked options
    (`from_options`) it checks nothing again.
    """

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048

    @classmethod
    def from_options(cls, options: SchedulerOptions, *, max_num_batched_tokens: int,
                     max_model_len: int, on_cuda: bool = False) -> SchedulerConfig:
        """The scheduler's config from (checked) options, the two resolved budgets and the
        device (`on_cuda`: which rule prefill_batching "auto" is)."""
        declared = {f.name: getattr(options, f.name) for f in fields(SchedulerOptions)}
        return cls(**declared | {"max_num_batched_tokens": max_num_batched_tokens,
                                 "max_model_len": max_model_len,
                                 "prefill_batching": resolve_mode(options.prefill_batching,
                                                                  on_cuda)})

    @property
    def policy(self) -> str:
        """vLLM's name of `scheduling_policy`."""
        return self.scheduling_policy


class Scheduler(ApplyMixin, SpeculationMixin):
    """Owns the request queues and the per-step batch, and allocates and frees every request's
    KV blocks through the KV manager (the engine reads the manager's stats and checks its
    invariants; it never allocates)."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManagerAPI,
                 kv_connector: StoreConnectorScheduler | None = None,
                 proposer: RequestProposer | None = None) -> None:
        """`kv_connector`: the KV store's scheduler side (pagedkv.store.connector, or the
        simulator's), None without a store. `proposer`: speculative decoding's engine-built
        proposer (a draft model), None to build it from `speculative_config`."""
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by _order_key
        self.running: list[Request] = []  # sorted by _order_key: the tail is preempted first
        self.swapped: list[Request] = []  # sorted by _order_key
        # Admitted, holding blocks, waiting for the KV store to load part of their prompt.
        self.loading: list[Request] = []
        self._finished_ids: list[str] = []  # ended since the last step; passed to the runner
        self.ended_in_schedule: list[Request] = []  # ended inside schedule(); reported by update()
        self._pending_hashes: set[bytes] = set()
        self._running_hashes: set[bytes] = set()
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions that swapped out to host blocks (not recompute)
        self.kv_connector = kv_connector
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Scheduled steps not yet applied by update(), with the prompt-block hashes each
        # computes (more than one only while overlapped scheduling builds the next step).
        self._unapplied: list[tuple[SchedulerOutput, set[bytes]]] = []
        self._slot = 0  # which of each request's two ScheduledRequests this step fills
        # Most tokens one request computes in a step (vLLM's long_prefill_token_threshold),
        # and this step's cap (`_step_prefill_cap`): none for a request alone.
        self._prefill_cap = config.long_prefill_token_threshold or sys.maxsize
        self._step_cap = self._prefill_cap
        # (A config built without `from_options`, the simulator's and the tests': "auto" as
        # on CPU.)
        self.batching = PrefillBatching(resolve_mode(config.prefill_batching, False),
                                        config.prefill_step_overhead_tokens,
                                        config.prefill_decode_overhead_tokens)
        self.beams = BeamSearch(self)  # the beam-search requests' groups (beam.py)
        self._init_speculation(config.speculative_config, proposer)  # proposer, spec_stats

    # ---- queues -------------------------------------------------------------------------

    def _order_key(self, request: Request) -> tuple:
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time, request.request_id)
        return (request.arrival_time, request.request_id)

    def _enqueue(self, queue: list[Request], request: Request) -> None:
        bisect.insort_right(queue, request, key=self._order_key)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._enqueue(self.waiting, request)
        if request.sampling_params.use_beam_search:
            self.beams.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- finishing ----------------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus,
                        reason: int | str | None = None) -> list[Request]:
        """End these requests (unknown ids are ignored) and free their blocks at once.

        Returns the requests that were ended by this call.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        if self.beams.groups:
            request_ids = self.beams.with_beams(list(request_ids))
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, status, reason)
            ended.append(request)
        return ended

    def _finish(self, request: Request, status: RequestStatus,
                reason: int | str | None = None) -> None:
        for queue in (self.running, self.waiting, self.swapped, self.loading):
            if request in queue:
                queue.remove(request)
                break
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.kv_connector.request_finished(request)  # before its blocks are freed
        self.kv_cache_manager.free(request)
        self.forget_drafts(request)
        request.status = status
        if status == RequestStatus.FINISHED_ERROR:
            request.error = str(reason)
        else:
            request.stop_reason = reason
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    # ---- scheduling ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step. Mutates queues, request states and the KV manager."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted = False
        # Hashes of the prompt blocks this step computes: a waiting request whose next block is
        # among them waits one step and then hits them in the prefix cache instead of
        # computing the same prefix again (a block is cached only once computed).
        self._pending_hashes = set()
        # ... and those of a step still running (overlapped scheduling): not cached yet either.
        self._running_hashes = set().union(*(hashes for _, hashes in self._unapplied))
        self._slot ^= 1
        if self.loading:
            self._finish_loads()
        self._step_cap = self._step_prefill_cap()

        index = 0
        running, allocate = self.running, self.kv_cache_manager.allocate_slots
        cap = self._step_cap
        while index < len(running) and budget > 0:
            request = running[index]
            ahead = request.num_tokens_ahead
            num_new = min(len(request.all_token_ids) + request.num_placeholders
                          - request.num_computed_tokens - ahead, budget, cap)
            if num_new <= 0:
                index += 1
                continue
            if num_new == 1 and request.spec_token_ids and not ahead:
                taken = self._schedule_speculative(request, budget, out)
                if taken:
                    budget -= taken
                    index += 1
                    continue
            # The usual case first: it fits (a None changes nothing `_allocate_running`'s own
            # first try would not, so that try may repeat it).
            if allocate(request, ahead + num_new, delay_cache_blocks=True,
                        num_tokens_ahead=ahead) is None:
                allocated, preempted_now = self._allocate_running(request, num_new, out)
                preempted = preempted or preempted_now
                if not allocated:
                    if index < len(running) and running[index] is request:
                        index += 1  # it waits for the running step (overlapped scheduling)
                    continue  # else `request` left the running list
            self._schedule(request, num_new, out)
            budget -= num_new
            index += 1

        if not preempted:
            budget = self._schedule_swapped(budget, out)
        if not preempted and not self.swapped:
            self._schedule_waiting(budget, out)

        out.blocks_to_copy = self.kv_cache_manager.take_block_copies()
        if self.kv_connector is not None:  # None when the store has nothing to do this step
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out, self.requests)
        out.finished_request_ids = self._finished_ids
        self._finished_ids = []
        self._unapplied.append((out, self._pending_hashes))
        return out

    def _step_prefill_cap(self) -> int:
        """The most tokens one request computes this step: the long-prefill cap keeps a long
        prompt from starving the other requests of the budget, so a request alone in the
        scheduler (running, waiting, swapped or loading) takes the whole budget, as in vLLM:
        a lone long prompt reaches its first token in budget-sized chunks, not capped ones."""
        others = len(self.running) + len(self.waiting) + len(self.swapped) + len(self.loading)
        return self._prefill_cap if others > 1 else sys.maxsize

    def _allocate_running(self, request: Request, num_new: int,
                          out: SchedulerOutput) -> tuple[bool, bool]:
        """Allocate for a running request, preempting from the tail until it fits.

        Returns (allocated, preempted_any). `allocated` is False when `request` itself was
        preempted or finished (it is then no longer in the running list), or when only
        requests the running step writes into could make room (overlapped scheduling: it
        stays running and waits for that step).
        """
        kv = self.kv_cache_manager
        preempted = False
        ahead = request.num_tokens_ahead  # allocated already, for the running step
        while kv.allocate_slots(request, ahead + num_new, delay_cache_blocks=True,
                                num_tokens_ahead=ahead) is None:
            victim = self._victim(request)
            if victim is None:
                return False, preempted
            if victim is request and len(self.running) == 1 and not self._can_ever_grow(request, num_new):
                # Alone in the cache and still no room: this sequence has hit the cache's size.
                self._finish(request, RequestStatus.FINISHED_LENGTH, None)
                self.ended_in_schedule.append(request)
                return False, preempted
            self._preempt(victim, out)
            preempted = True
            if victim is request:
                return False, True
        return True, preempted

    def _victim(self, request: Request) -> Request | None:
        """The request to preempt so that `request` fits: `running` is kept in priority /
        arrival order, so the tail is the lowest-priority, newest request, and it was not
        scheduled earlier in this step. Requests the running step writes into are skipped;
        None when only those stand between the tail and `request`."""
        for victim in reversed(self.running):
            if not victim.num_tokens_ahead:
                return victim
            if victim is request:
                return None
        return None

    def _can_ever_grow(self, request: Request, num_new: int) -> bool:
        needed = cdiv(request.num_computed_tokens + request.num_tokens_ahead + num_new,
                      self.block_size)
        return needed <= self.kv_cache_manager.num_usable_blocks

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        self.running.remove(request)
        self.forget_drafts(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and kv.can_swap_out(request):
            out.blocks_to_swap_out.extend(kv.swap_out(request))
            out.swapped_request_ids.append(request.request_id)
            self.num_swaps += 1
            request.status = RequestStatus.SWAPPED
            self._enqueue(self.swapped, request)
            return
        kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self._enqueue(self.waiting, request)

    def _schedule_swapped(self, budget: int, out: SchedulerOutput) -> int:
        kv = self.kv_cache_manager
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if not kv.can_swap_in(request):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(kv.swap_in(request))
            out.swapped_request_ids.append(request.request_id)
            request.status = RequestStatus.RUNNING
            self._enqueue(self.running, request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          self._step_cap)
            if num_new > 0 and kv.allocate_slots(request, num_new, delay_cache_blocks=True) is not None:
                self._schedule(request, num_new, out)
                budget -= num_new
        return budget

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> None:
        kv = self.kv_cache_manager
        # New prompt tokens to start this step (prefill_batching.py), and those started.
        target, started = self.batching.target_tokens(self.waiting, len(out.scheduled), budget), 0
        while (self.waiting and budget > 0 and started < target
               and len(self.running) + len(self.loading) < self.config.max_num_seqs):
            request = self.waiting[0]
            computed_blocks, num_hit_tokens = self._prefix_hits(request)
            # A sub-block hit ends inside a block: the store (whole blocks) is not asked then.
            num_external = (0 if self.kv_connector is None or request.wants_prompt_logprobs
                            or num_hit_tokens % self.block_size else
                            self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens))
            if ((self._pending_hashes or self._running_hashes) and not request.wants_prompt_logprobs
                    and self._next_block_is_pending(request, num_hit_tokens // self.block_size)):
                break
            status = kv.can_allocate(request, computed_blocks=computed_blocks)
            if status == AllocStatus.NEVER:
                self._finish(request, RequestStatus.FINISHED_ERROR, self._never_message(request))
                self.ended_in_schedule.append(request)
                continue
            if status == AllocStatus.LATER:
                break
            num_new = min(request.num_tokens - num_hit_tokens, budget, self._step_cap)
            # The prompt tokens the next step can hold: its budget less a token for each
            # running request (each computes at least one then), or the long-prefill cap.
            next_room = min(self.config.max_num_batched_tokens - len(self.running),
                            self._step_cap)
            if not num_external and self.batching.holds_back(
                    self.waiting, request.num_tokens - num_hit_tokens, num_new, next_room):
                break
            # With store tokens, only their blocks now: the rest is computed once they loaded.
            blocks = kv.allocate_slots(request, num_external or num_new, computed_blocks,
                                       num_hit_tokens, delay_cache_blocks=True,
                                       apply_watermark=True,
                                       num_external_computed_tokens=num_external)
            if blocks is None and num_hit_tokens % self.block_size:
                # A sub-block hit's copy needs one block more than can_allocate counts (the
                # source is held while copied): at the pool's edge, run with the whole-block
                # hit rather than wait for blocks nothing may ever free.
                computed_blocks, num_hit_tokens = kv.drop_partial_hit(computed_blocks,
                                                                      num_hit_tokens)
                num_new = min(request.num_tokens - num_hit_tokens, budget, self._step_cap)
                blocks = kv.allocate_slots(request, num_new, computed_blocks, num_hit_tokens,
                                           delay_cache_blocks=True, apply_watermark=True)
            if blocks is None:
                break
            self.waiting.pop(0)
            request.num_computed_tokens = num_hit_tokens
            if num_external:  # loads in the background; the request waits, holding its blocks
                self.kv_connector.update_state_after_alloc(request, num_hit_tokens, num_external)
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading.append(request)
                continue
            self._start_running(request, num_hit_tokens)
            self._schedule(request, num_new, out)
            budget -= num_new
            started += num_new

    def _start_running(self, request: Request, num_hit_tokens: int) -> None:
        """An admitted request joins the running queue (first admission: its cache stats)."""
        if request.num_cached_tokens < 0:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = request.num_computed_tokens
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        request.status = RequestStatus.RUNNING
        self._enqueue(self.running, request)

    def _finish_loads(self) -> None:
        """Requests whose store load finished run now, from the last block loaded intact:
        only those blocks enter the prefix cache; the rest are computed like any prompt."""
        for request, num_loaded in self.kv_connector.take_finished_loads():
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            self.loading.remove(request)
            num_hit_tokens = request.num_computed_tokens
            request.num_computed_tokens += num_loaded
            # Blocks whose bytes never arrived are computed into fresh blocks.
            self.kv_cache_manager.trim_blocks(request, request.num_computed_tokens)
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            self._start_running(request, num_hit_tokens)

    def _prefix_hits(self, request: Request) -> tuple[list, int]:
        """The request's prefix-cache hit; none for a request that wants prompt logprobs (it
        must compute every prompt position, as vLLM does; its blocks are still cached)."""
        if request.wants_prompt_logprobs:
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(request)

    def _next_block_is_pending(self, request: Request, num_hit_blocks: int) -> bool:
        hashes = self.kv_cache_manager.get_block_hashes(request.request_id)
        return num_hit_blocks < len(hashes) and (hashes[num_hit_blocks] in self._pending_hashes
                                                 or hashes[num_hit_blocks] in self._running_hashes)

    def _note_pending_prompt_blocks(self, request: Request, start: int, num_new: int) -> None:
        """Remember the hashes of the prompt blocks that this step fills from `start`, inside
        the prompt (caching only)."""
        kv = self.kv_cache_manager
        if not kv.enable_caching:
            return
        hashes = kv.update_block_hashes(request)
        end = min(start + num_new, request.num_prompt_tokens) // self.block_size
        self._pending_hashes.update(hashes[start // self.block_size:end])

    def _never_message(self, request: Request) -> str:
        kv = self.kv_cache_manager
        needed = cdiv(request.num_tokens, self.block_size)
        return (f"request {request.request_id!r} needs {needed} KV blocks for its "
                f"{request.num_tokens} tokens but the cache can never give more than "
                f"{kv.num_usable_blocks - kv.watermark_blocks} (block_size={self.block_size}); "
                "raise the KV cache size or shorten the prompt")

    def _schedule(self, request: Request, num_new: int, out: SchedulerOutput,
                  drafts: list[int] | None = None) -> None:
        """Append the request's share of this step to `out` (one of its two reusable
        ScheduledRequests) and count it as scheduled ahead until `update()` applies it.
        `drafts`: speculative tokens verified after its one new token (speculation.py)."""
        start = request.num_computed_tokens + request.num_tokens_ahead
        if start < request.num_prompt_tokens:
            self._note_pending_prompt_blocks(request, start, num_new)
        all_tokens = request.all_token_ids
        num_outputs = len(request.output_token_ids) + request.num_placeholders
        num_samples = 0
        params = request.sampling_params
        if start + num_new == len(all_tokens) + request.num_placeholders:  # reaches the end
            first_sample = num_outputs == 0 and request.parent_id is None
            num_samples = params.n if first_sample else 1
        token_ids = all_tokens[start:start + num_new]
        if len(token_ids) < num_new:  # tokens the running step samples: filled in later
            token_ids += [PLACEHOLDER_TOKEN_ID] * (num_new - len(token_ids))
        if drafts:
            token_ids += drafts
            num_new += len(drafts)
        prompt_logprob_rows = 0
        if params.prompt_logprobs is not None:
            prompt_logprob_rows = max(min(start + num_new, request.num_prompt_tokens - 1) - start, 0)
        kv, slot, request_id = self.kv_cache_manager, self._slot, request.request_id
        scheduled = request.scheduled_slots[slot]
        if scheduled is None:
            scheduled = request.scheduled_slots[slot] = ScheduledRequest(
                request_id, token_ids, start, [], params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids, sample_index=request.sample_index)
        else:
            scheduled.token_ids = token_ids
            scheduled.start_pos = start
        scheduled.block_table = kv.sync_block_ids(request_id, request.block_id_tables[slot])
        scheduled.num_samples = num_samples
        scheduled.banned_token_ids = banned_token_ids(request, num_outputs) if num_samples and (
            num_outputs < params.min_tokens or request.bad_words_token_ids) else ()
        scheduled.num_prompt_logprob_rows = prompt_logprob_rows
        scheduled.grammar = request.structured_output if num_samples else None
        scheduled.group_block_tables = kv.get_group_block_ids(request_id)
        scheduled.spec_token_ids = drafts or []
        out.scheduled.append(scheduled)
        out.total_num_scheduled_tokens += num_new
        request.num_tokens_ahead += num_new
        if num_samples:
            request.num_placeholders += 1

    def forget_unapplied(self) -> None:
        """Drop the steps scheduled but never to be applied (a failed engine step; every
        request is ended next): their prompt blocks no longer count as being computed."""
        self._unapplied = []

    def fill_placeholders(self, out: SchedulerOutput) -> None:
        """(Overlapped scheduling) `out` was built while the step before it ran; that step is
        now applied. Write its sampled tokens over `out`'s placeholders (and the bad-word bans
        that depend on them), and drop from `out` the requests that finished meanwhile (their
        blocks are free already). Mutates `out.scheduled` and its ScheduledRequests."""
        kept = []
        requests = self.requests
        for scheduled in out.scheduled:
            request = requests.get(scheduled.request_id)
            if request is None or not self._owns(request, scheduled):
                out.total_num_scheduled_tokens -= len(scheduled.token_ids)
                continue
            if PLACEHOLDER_TOKEN_ID in scheduled.token_ids:
                start = scheduled.start_pos
                scheduled.token_ids = request.all_token_ids[start:start + len(scheduled.token_ids)]
                if scheduled.num_samples and request.bad_words_token_ids:
                    scheduled.banned_token_ids = banned_token_ids(request, request.num_output_tokens)
            kept.append(scheduled)
        out.scheduled = kept

    @staticmethod
    def _owns(request: Request, scheduled: ScheduledRequest) -> bool:
        """Whether `scheduled` is this request's (not an ended one's that had the same id)."""
        slots = request.scheduled_slots
        return slots[0] is scheduled or slots[1] is scheduled

    # ---- introspection ------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise RuntimeError if queues and KV state disagree (for tests and debugging)."""
        queued = self.running + self.waiting + self.swapped + self.loading
        if len(queued) != len(self.requests) or {r.request_id for r in queued} != set(self.requests):
            raise RuntimeError("scheduler queues do not match the live requests")
        for request in self.swapped:
            if not self.kv_cache_manager.is_swapped(request.request_id):
                raise RuntimeError(f"{request.request_id} is in the swapped queue but holds no host blocks")
        self.kv_cache_manager.check_invariants()
