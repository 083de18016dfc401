"""EngineCore: the scheduler, the KV cache manager, the model runner, the KV store and the
KV-event publisher, stepped one batch at a time. It takes tokenized requests
(`EngineCoreRequest`) and returns, per step, only what is new for each sample (`CoreOutput`):
text, stop strings and cumulative outputs are the frontend's (`output_processor.py`).

It runs in the frontend's process (`core_client.InprocCoreClient`) or in its own
(`core_proc.py`, for `pagedkv serve`). Not thread-safe: one thread owns a core.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedkv.config.errors import EngineFatalError, ErrorKind
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.compose import CoreParts, build_core
from pagedkv.engine.dashboard_calls import DashboardCalls
from pagedkv.engine.draft_proposer import draft_facts, shutdown_draft
from pagedkv.engine.messages import CoreOutput, EngineCoreRequest, EngineReady, params_from_wire
from pagedkv.engine.overlap import OverlappedStepper
from pagedkv.engine.runner_facts import runner_facts
from pagedkv.engine.stats import EngineStats, IterationTokens, scheduler_stats
from pagedkv.events.publisher import to_wire_events
from pagedkv.kv.pins import PinInfo
from pagedkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedkv.sched.request import FINISHED_STATUSES, Request, RequestStatus
from pagedkv.sched.validation import check_cache_salt

if TYPE_CHECKING:
    from pagedkv.model.tokenizer import Tokenizer
    from pagedkv.structured.backend import XGrammarBackend

logger = logging.getLogger(__name__)


def _step_failed(cause: str) -> str:
    """The error of a request whose model step failed (ErrorKind.INTERNAL)."""
    return f"internal error: the model step failed: {cause}"


class EngineCore:
    """See the module docstring. `step()` mutates the scheduler's queues, the KV manager's
    blocks and the runner's cache; the outputs it returns are new objects each step."""

    def __init__(self, parts: CoreParts) -> None:
        """Own `parts` (compose.py builds them: `EngineCore.from_args`)."""
        self.args = parts.args
        self.tokenizer = parts.tokenizer
        self.runner = parts.executor
        self.kv_setup = parts.kv_setup
        self.max_model_len = parts.kv_setup.max_model_len
        self.scheduler = parts.scheduler
        self.kv_store = parts.kv_store
        self.event_publisher = parts.event_publisher
        self.step_log = parts.step_log
        self.model_config = self.runner.model_config
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self._structured_backend: XGrammarBackend | None = None
        self._structured_lock = threading.Lock()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.iteration_tokens = IterationTokens()  # tokens per step, for vllm:iteration_tokens_total
        self.dashboard = DashboardCalls(self)  # the dashboard's utility calls
        # prefill/decode disaggregation's utility calls (kv_transfer_config), None without
        self.kv_transfer = parts.kv_transfer
        # Closed once: by shutdown(), or when the core is garbage-collected.
        self._closers = [weakref.finalize(self, closable.close)
                         for closable in (self.kv_transfer, self.kv_store, self.event_publisher,
                                          self.step_log)
                         if closable is not None]
        self.overlap: OverlappedStepper | None = None
        if self.args.async_scheduling:  # (refused with a KV store: EngineArgs.validate)
            from pagedkv.model.runner import resolve_device

            self.overlap = OverlappedStepper(self, str(resolve_device(self.args.device)))

    @classmethod
    def from_args(cls, args: EngineArgs, tokenizer: Tokenizer | None = None) -> EngineCore:
        """The core `args` describe, its parts built by `compose.build_core` (which loads the
        model; a failed start leaves no rank, store thread or weight behind)."""
        return cls(build_core(args, tokenizer))

    def ready(self) -> EngineReady:
        kv = self.scheduler.kv_cache_manager
        return EngineReady(max_model_len=self.max_model_len, vocab_size=self.vocab_size,
                           block_size=kv.block_size, num_usable_blocks=kv.num_usable_blocks,
                           watermark_blocks=kv.watermark_blocks,
                           num_gpu_blocks=self.kv_setup.num_blocks,
                           eos_token_ids=list(self.eos_token_ids),
                           kv_cache_dtype=self.kv_setup.spec.dtype,
                           block_bytes=self.kv_setup.spec.page_size_bytes,
                           max_blocks_per_request=self.kv_setup.spec.max_blocks_per_seq(
                               self.max_model_len),
                           kv_budget=self.kv_setup.budget,
                           **runner_facts(self.runner), **draft_facts(self.scheduler.proposer))

    @property
    def structured_output_backend(self) -> XGrammarBackend:
        """The grammar compiler of this core's tokenizer, built on first use (thread-safe)."""
        with self._structured_lock:
            if self._structured_backend is None:
                from pagedkv.structured.backend import XGrammarBackend

                self._structured_backend = XGrammarBackend(
                    self.tokenizer, self.vocab_size,
                    limits=self.args.structured_outputs_limits())
            return self._structured_backend

    def shutdown(self) -> None:
        """Abort every request, close the KV store and the event publisher, free the runner's
        memory. Idempotent."""
        if self.runner is None:
            return
        if self.overlap is not None:
            self.overlap.close()
        self.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        for close in self._closers:
            close()
        if self._structured_backend is not None:
            self._structured_backend.close()
        runner, self.runner = self.runner, None
        runner.shutdown()
        shutdown_draft(self.scheduler.proposer)

    # ---- requests -----------------------------------------------------------------------

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queue a tokenized request (checked by the frontend). ValueError for an id in use or
        a structured-output constraint that does not compile."""
        params = params_from_wire(core_request.sampling_params)
        request = Request(request_id=core_request.request_id,
                          prompt_token_ids=core_request.prompt_token_ids, sampling_params=params,
                          eos_token_ids=self.eos_token_ids, arrival_time=core_request.arrival_time,
                          priority=core_request.priority, cache_salt=core_request.cache_salt)
        if params.structured_outputs is not None:
            request.structured_output = self.structured_output_backend.grammar(
                params.structured_outputs)
        request.bad_words_token_ids = core_request.bad_words_token_ids
        self.scheduler.add_request(request)
        self.prompt_tokens_total += request.num_prompt_tokens

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        reason: int | str | None = None) -> None:
        """End these samples (unknown ids are ignored); their blocks go back at once."""
        self.scheduler.finish_requests(list(request_ids), status, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """Schedule, run the model, apply the sampled tokens; the new tokens (and finishes) of
        each sample that progressed. [] when there was nothing to do. With `async_scheduling`
        the forward pass runs on after this returns (overlap.py): the outputs are the step
        before's, and the next step is built while the forward runs."""
        if self.runner is None:
            raise RuntimeError("the engine was shut down")
        if self.step_log is not None:
            self.step_log.step_started()
        if self.overlap is not None:
            return self.overlap.step()
        scheduler_output = self.scheduler.schedule()
        return self.apply_step(scheduler_output, self.execute(scheduler_output))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | Exception:
        """Run the model on one step (any one thread at a time). An empty step does not reach
        the runner (a step with only finished ids does: it drops their sampling state). A
        failure comes back as the exception (it ends only this step's requests), except
        `EngineFatalError` (e.g. a tensor-parallel rank died), which ends the engine."""
        if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
            return ModelRunnerOutput()
        try:
            return self.runner.execute(scheduler_output)
        except EngineFatalError:
            raise
        except Exception as exc:
            return exc

    def apply_step(self, scheduler_output: SchedulerOutput,
                   result: ModelRunnerOutput | Exception) -> list[CoreOutput]:
        """Apply a step's result (`execute`'s) to the scheduler; its outputs. Mutates the
        scheduler, the KV manager and the stats; publishes the step's KV events."""
        if isinstance(result, Exception):
            return self._fail_step(scheduler_output, result)
        if scheduler_output.scheduled:
            self.iteration_tokens.observe(scheduler_output.total_num_scheduled_tokens)
        changed = self.scheduler.update(scheduler_output, result)
        if self.event_publisher is not None:
            self._publish_kv_events()
        outputs = self._outputs(changed)
        if self.step_log is not None:
            self.step_log.step_ended(scheduler_output, self.scheduler.has_unfinished_requests())
        return outputs

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[CoreOutput]:
        """The runner raised: end the step's requests (scheduled, or swapped out or in: their
        KV is unknown) with an error and free their blocks; every other request goes on."""
        ids = [r.request_id for r in scheduler_output.scheduled]
        ids += scheduler_output.swapped_request_ids
        logger.exception("model step failed; ending its %d requests", len(set(ids)))
        failed = self.scheduler.finish_requests(
            list(dict.fromkeys(ids)), RequestStatus.FINISHED_ERROR,
            _step_failed(f"{type(exc).__name__}: {exc}"))
        changed = self.scheduler.update(scheduler_output, ModelRunnerOutput())
        return self._outputs(failed, ErrorKind.INTERNAL) + self._outputs(changed)

    def fail_all(self, reason: str) -> list[CoreOutput]:
        """End every request with an internal error (a step raised outside the runner). With
        overlapped scheduling the running forward pass is waited for and its step dropped."""
        if self.overlap is not None:
            self.overlap.abandon()
        self.scheduler.forget_unapplied()
        failed = self.scheduler.finish_requests(list(self.scheduler.requests),
                                                RequestStatus.FINISHED_ERROR,
                                                _step_failed(reason))
        return self._outputs(failed, ErrorKind.INTERNAL)

    def _publish_kv_events(self) -> None:
        """Send this step's block-pool events (one batch) to the publisher thread."""
        kv = self.scheduler.kv_cache_manager
        events = to_wire_events(kv.take_events())
        if self.kv_store is not None:
            events += self.kv_store.take_events()
        self.event_publisher.publish(events)

    def _outputs(self, changed: list[Request], error_kind: ErrorKind = ErrorKind.INVALID
                 ) -> list[CoreOutput]:
        """Each changed sample's news since its last output: O(new tokens) per sample.
        `error_kind`: why those that ended with an error did (the scheduler ends a request with
        an error for its own sake, e.g. it can never fit: INVALID; a failed step's: INTERNAL)."""
        outputs = []
        generated = 0
        for request in changed:
            sent = request.num_output_reported
            tokens = request.output_token_ids
            new = tokens[sent:]
            num_tokens = len(tokens)
            request.num_output_reported = num_tokens
            generated += num_tokens - sent
            cached = request.num_cached_tokens
            out = CoreOutput(request.request_id, new, num_cached_tokens=cached if cached > 0 else 0,
                             num_preemptions=request.num_preemptions,
                             parent_id=request.parent_id, sample_index=request.sample_index)
            params = request.sampling_params
            if params.logprobs is not None:
                out.new_logprobs = request.output_logprobs[sent:]
            if not request.reported_scheduled and request.first_scheduled_time is not None:
                out.first_scheduled_time = request.first_scheduled_time
                request.reported_scheduled = True
            if (params.prompt_logprobs is not None and request.sample_index == 0
                    and len(request.prompt_logprobs) != request.num_prompt_logprobs_reported):
                out.prompt_logprobs = list(request.prompt_logprobs)
                request.num_prompt_logprobs_reported = len(request.prompt_logprobs)
            if request.status in FINISHED_STATUSES:
                out.finish_reason = request.status.value
                out.stop_reason = request.stop_reason
                if request.status == RequestStatus.FINISHED_ERROR:
                    out.error = request.error
                    out.error_kind = error_kind
            outputs.append(out)
        self.generation_tokens_total += generated
        return outputs

    # ---- utility calls (between steps) --------------------------------------------------

    def get_stats(self) -> EngineStats:
        return scheduler_stats(
            self.scheduler, prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            iteration_token_counts=self.iteration_tokens.snapshot()[0],
            iteration_tokens_sum=self.iteration_tokens.snapshot()[1],
            kv_store_tiers=() if self.kv_store is None else tuple(
                t.to_dict() for t in self.kv_store.snapshot_stats()))

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def is_prefix_cached(self, token_ids: list[int], cache_salt: str | None = None) -> bool:
        check_cache_salt(cache_salt)
        return self.scheduler.kv_cache_manager.pins.is_cached(token_ids, cache_salt)

    def pin_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> PinInfo:
        check_cache_salt(cache_salt)
        return self.scheduler.kv_cache_manager.pin_prefix(token_ids, cache_salt)

    def unpin_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> PinInfo:
        check_cache_salt(cache_salt)
        return self.scheduler.kv_cache_manager.unpin_prefix(token_ids, cache_salt)

    def now(self) -> float:
        """The core's time.monotonic() (a liveness probe and clock check)."""
        return time.monotonic()
