"""LLMEngine: tokenizer + scheduler + model runner, one `step()` at a time.

    add_request -> Scheduler.schedule -> ModelRunner.execute -> Scheduler.update
                -> incremental detokenization, stop strings -> RequestOutput

Not thread-safe: one thread owns an engine (the server runs it in a background thread).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedkv.config.errors import EngineFatalError
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.kv_setup import (
    GpuMemoryProfile,
    KVCacheSetup,
    plan_kv_cache,
    resolve_max_num_batched_tokens,
)
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.stats import EngineStats, IterationTokens
from pagedkv.events.config import parse_kv_events_config
from pagedkv.events.publisher import make_event_publisher, to_wire_events
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.pins import PinInfo
from pagedkv.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedkv.sched.request import Request, RequestStatus, child_request_id
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sched.scheduler import Scheduler, SchedulerConfig
from pagedkv.sched.validation import PromptTooLongError, check_cache_salt, check_priority
from pagedkv.store.factory import attach_kv_store
from pagedkv.utils import cdiv

if TYPE_CHECKING:
    from pagedkv.structured.backend import XGrammarBackend

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict

# The start of `RequestOutput.error` when the model step of a request failed (a server fault,
# unlike a request the cache can never hold).
STEP_FAILED = "internal error: the model step failed"


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
    first_scheduled_time: float | None = None
    num_preemptions: int = 0  # the most any of its samples was preempted
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        # Children are forked together with the first sampled token; a request that ends with
        # no token (error, abort) never gets them.
        first = self.completions.get(0)
        if first is None or first.finish_reason is None:
            return False
        if not first.token_ids and len(self.completions) == 1:
            return True
        return (len(self.completions) == self.params.n
                and all(c.finish_reason is not None for c in self.completions.values()))

    def output(self) -> RequestOutput:
        outputs = [self.completions[i] for i in sorted(self.completions)]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_copy_completion(c) for c in outputs], finished=self.finished,
            num_cached_tokens=self.num_cached_tokens, error=self.error,
            metrics={"arrival_time": self.arrival_time,
                     "first_token_time": self.first_token_time or 0.0,
                     "first_scheduled_time": self.first_scheduled_time or 0.0,
                     "num_preemptions": float(self.num_preemptions)},
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    """A snapshot the caller may keep: the engine goes on appending to `c`'s lists."""
    return replace(c, token_ids=list(c.token_ids),
                   logprobs=None if c.logprobs is None else list(c.logprobs))


class LLMEngine:
    """The engine. See module docstring; `step()` returns cumulative outputs of the requests
    that progressed (got tokens or finished) in that step."""

    def __init__(self, args: EngineArgs) -> None:
        # Imported here so `pagedkv.engine` stays light until an engine is really built.
        from pagedkv.engine.executor import build_executor
        from pagedkv.model.cuda_graphs import decode_batch_sizes
        from pagedkv.model.loader import check_model_dir
        from pagedkv.model.runner import resolve_device
        from pagedkv.model.tokenizer import Tokenizer

        args.validate()
        if not args.model:
            raise ValueError("model must be a model directory, got ''")
        check_model_dir(args.model)  # config.json vs the checkpoint, before sizing anything
        self.args = args
        self.tokenizer = Tokenizer.from_dir(args.tokenizer or args.model)
        profiled = resolve_device(args.device).type == "cuda" \
            and args.num_gpu_blocks_override is None and args.kv_cache_memory_bytes is None
        setup: KVCacheSetup | None = None if profiled else plan_kv_cache(args)  # fails early
        # The executor: the ModelRunner itself, or rank 0 of a tensor-parallel group (the
        # scheduler below decides once, on rank 0, for every rank).
        self.runner = build_executor(args, None if setup is None else setup.spec)
        if setup is None:
            setup = plan_kv_cache(args, self._profile_memory(args))
        self.kv_setup = setup
        self.max_model_len = setup.max_model_len
        self.runner.allocate_kv_cache(setup.num_blocks, setup.num_host_blocks)
        if not args.enforce_eager:
            self.runner.capture_cuda_graphs(decode_batch_sizes(args.max_num_seqs),
                                            setup.max_model_len)
        self.model_config = self.runner.model_config
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        events_config = parse_kv_events_config(args.kv_events_config)
        kv = KVCacheManager.from_spec(
            setup.spec, num_blocks=setup.num_blocks,
            num_host_blocks=setup.num_host_blocks, enable_caching=args.enable_prefix_caching,
            watermark=args.watermark, hash_algo=args.prefix_caching_hash_algo,
            enable_kv_cache_events=events_config.enabled, eviction_policy=args.eviction_policy,
            max_pinned_fraction=args.max_pinned_fraction,
            prefix_match_unit=args.prefix_match_unit,
            max_num_batched_tokens=setup.max_num_batched_tokens)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=self.max_model_len, preemption_mode=args.preemption_mode,
            policy=args.scheduling_policy), kv)
        self._groups: dict[str, _Group] = {}
        self._structured_backend: XGrammarBackend | None = None
        self._structured_lock = threading.Lock()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.iteration_tokens = IterationTokens()  # tokens per step, for vllm:iteration_tokens_total
        self.kv_store = attach_kv_store(args, setup.sliding_window, self.runner, self.scheduler,
                                        events_config.enabled)
        self.event_publisher = make_event_publisher(events_config)
        # Closed once: by shutdown(), or when the engine is garbage-collected.
        self._closers = [weakref.finalize(self, closable.close)
                         for closable in (self.kv_store, self.event_publisher)
                         if closable is not None]

    def _profile_memory(self, args: EngineArgs) -> GpuMemoryProfile:
        """(CUDA, no explicit KV size) This engine's weights and the peak activation of a
        profile forward pass at max_num_batched_tokens, and the memory free afterwards."""
        import torch

        runner = self.runner

        max_len = args.max_model_len or runner.model_config.max_position_embeddings
        peak = runner.profile_activation_peak(resolve_max_num_batched_tokens(args),
                                              args.max_num_seqs, max_len)
        free, total = torch.cuda.mem_get_info(runner.device)
        return GpuMemoryProfile(total_bytes=total, free_bytes=free,
                                weights_bytes=runner.weights_bytes, activation_peak_bytes=peak)

    @property
    def is_shut_down(self) -> bool:
        return self.runner is None

    def shutdown(self) -> None:
        """Abort every request, stop the KV store's saver, the KV-event publisher and the
        grammar compile pool, and free the model runner's device memory (KV cache, CUDA
        graphs, weights). Idempotent; the engine cannot step afterwards."""
        if self.runner is None:
            return
        self.abort_request(list(self._groups))
        for close in self._closers:
            close()
        if self._structured_backend is not None:
            self._structured_backend.close()
        runner, self.runner = self.runner, None
        runner.shutdown()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ---- requests -----------------------------------------------------------------------

    @property
    def structured_output_backend(self) -> XGrammarBackend:
        """The grammar compiler of this engine's tokenizer, built on first use (importing
        xgrammar is slow). Thread-safe; its `compile` may be called from any thread."""
        with self._structured_lock:
            if self._structured_backend is None:
                from pagedkv.structured.backend import XGrammarBackend

                self._structured_backend = XGrammarBackend(
                    self.tokenizer, self.vocab_size,
                    limits=self.args.structured_outputs_limits())
            return self._structured_backend

    @property
    def built_structured_output_backend(self) -> XGrammarBackend | None:
        """The grammar compiler if already built, else None (never builds it)."""
        return self._structured_backend

    def truncate_prompt(self, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last `truncate_prompt_tokens` ids (-1: the most that leave room for one
        generated token; None: all), as vLLM truncates from the left."""
        if truncate_prompt_tokens is None:
            return ids
        keep = self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        return ids[-keep:] if len(ids) > keep else ids

    def tokenize_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                        ) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids), keeping only the last
        `truncate_prompt_tokens` ids when given; raises ValueError for bad prompts."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
            else:
                raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if truncate_prompt_tokens is None:  # too long is an error: tokenize a prefix only
                try:
                    ids = self.tokenizer.encode_bounded(text, self.max_model_len - 1)
                except PromptTooLongError as exc:
                    raise ValueError(
                        f"prompt has at least {exc.num_tokens} tokens but max_model_len is "
                        f"{self.max_model_len} (the prompt plus at least one generated token "
                        "must fit)") from None
            else:
                ids = self.tokenizer.encode(text)
        ids = self.truncate_prompt(list(ids), truncate_prompt_tokens)
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is out of the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        return text, ids

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError when this prompt with `params.n` samples can never fit in the cache."""
        kv = self.scheduler.kv_cache_manager
        block_size = kv.block_size
        prompt_blocks = cdiv(num_prompt_tokens + 1, block_size)
        # n samples share the prompt's full blocks; each other sample needs one block of its own.
        needed = prompt_blocks + params.n - 1
        available = kv.num_usable_blocks - kv.watermark_blocks
        if needed > available:
            raise ValueError(f"a prompt of {num_prompt_tokens} tokens with n={params.n} needs at least "
                             f"{needed} KV blocks but the cache can hold only {available}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError for a bad prompt, priority or cache_salt, a
        duplicate id, or a prompt whose `params.n` samples can never fit in the KV cache."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_id_free(request_id, params.n)
        check_cache_salt(cache_salt)
        check_priority(priority)
        self._check_token_ids(params)
        text, ids = self.tokenize_prompt(prompt, params.truncate_prompt_tokens)
        self.check_fits(len(ids), params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        request = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                          eos_token_ids=self.eos_token_ids, arrival_time=arrival,
                          priority=priority, cache_salt=cache_salt)
        if params.structured_outputs is not None:
            request.structured_output = self.structured_output_backend.grammar(
                params.structured_outputs)
        if params.bad_words:
            request.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        self.scheduler.add_request(request)
        self._groups[request_id] = _Group(request_id=request_id, prompt=text, prompt_token_ids=ids,
                                          params=params, arrival_time=arrival)
        self.prompt_tokens_total += len(ids)

    def _check_token_ids(self, params: SamplingParams) -> None:
        """ValueError when logit_bias or allowed_token_ids name an id beyond the vocabulary."""
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name} has token id {bad}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (vLLM's two spellings)."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _check_id_free(self, request_id: str, n: int) -> None:
        """Raise ValueError if `request_id` or the ids of its samples 1..n-1 are taken."""
        taken = self.scheduler.requests
        ids = [request_id] + [child_request_id(request_id, i) for i in range(1, n)]
        clash = next((i for i in ids if i in self._groups or i in taken), None)
        if clash is None and "#" in request_id:  # may name a sample of a live request
            parent, _, index = request_id.rpartition("#")
            group = self._groups.get(parent)
            if group is not None and index.isdigit() and 0 < int(index) < group.params.n:
                clash = request_id
        if clash is not None:
            raise ValueError(f"request id {clash!r} is already in use")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (all their samples); their blocks go back at once. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            sample_ids = [rid] + [child_request_id(rid, i) for i in range(1, group.params.n)]
            self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- pinned prefixes ----------------------------------------------------------------

    def _pin_ids(self, prompt: PromptType, cache_salt: str | None) -> list[int]:
        """The prompt's token ids, as add_request would take them; ValueError for a bad
        prompt or cache_salt."""
        check_cache_salt(cache_salt)
        return self.tokenize_prompt(prompt)[1]

    def is_prefix_cached(self, prompt: PromptType, cache_salt: str | None = None) -> bool:
        """Whether every full block of `prompt` (salted and hashed as a request's would be) is
        in the device prefix cache now. ValueError for a bad prompt or salt, or a prompt
        shorter than one block."""
        ids = self._pin_ids(prompt, cache_salt)
        return self.scheduler.kv_cache_manager.pins.is_cached(ids, cache_salt)

    def pin_prefix(self, prompt: PromptType, cache_salt: str | None = None) -> PinInfo:
        """Pin the leading run of `prompt`'s full blocks that is in the device prefix cache now
        (salted and hashed as a request's): no policy evicts them until `unpin_prefix`, and
        `reset_prefix_cache` keeps them. Computes nothing: `LLM.pin_prefix` and the server's
        /v1/pin run the prompt first when it is not cached. Pinning the same prompt again
        replaces its pin. ValueError for a bad prompt or salt, a prompt shorter than one block,
        or more pinned blocks than `max_pinned_fraction` of the cache."""
        ids = self._pin_ids(prompt, cache_salt)
        return self.scheduler.kv_cache_manager.pin_prefix(ids, cache_salt)

    def unpin_prefix(self, prompt: PromptType, cache_salt: str | None = None) -> PinInfo:
        """Release `prompt`'s pin: its blocks stay cached and become evictable again.
        `pagedkv.kv.pins.NotPinnedError` (a ValueError) when it is not pinned."""
        ids = self._pin_ids(prompt, cache_salt)
        return self.scheduler.kv_cache_manager.unpin_prefix(ids, cache_salt)

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step: schedule, run the model (block moves, forward pass, sampling),
        apply the sampled tokens, detokenize.

        Mutates the scheduler's queues and requests, the KV manager's block tables and pool,
        the runner's KV cache and sampling generators. Returns one cumulative `RequestOutput`
        per request group that progressed or finished this step (a new object each step: it
        stays valid, and never changes, after later steps); a finished group is forgotten
        after its last output. [] when there was nothing to do.
        """
        if self.runner is None:
            raise RuntimeError("the engine was shut down")
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
            result = ModelRunnerOutput()
        else:  # also when only finished ids: the runner drops their sampling state
            try:
                result = self.runner.execute(scheduler_output)
            except EngineFatalError:  # e.g. a tensor-parallel rank died: the engine ends
                raise
            except Exception as exc:  # ends only this step's requests
                return self._fail_step(scheduler_output, exc)
        if scheduler_output.scheduled:
            self.iteration_tokens.observe(sum(len(s.token_ids) for s in scheduler_output.scheduled))
        changed = self.scheduler.update(scheduler_output, result)
        if self.event_publisher is not None:
            self._publish_kv_events()
        return self._process(changed)

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The runner raised: end the step's requests (scheduled, or swapped out or in: their
        KV is unknown) with an error and free their blocks; every other request goes on."""
        ids = [r.request_id for r in scheduler_output.scheduled]
        ids += scheduler_output.swapped_request_ids
        logger.exception("model step failed; ending its %d requests", len(set(ids)))
        failed = self.scheduler.finish_requests(
            list(dict.fromkeys(ids)), RequestStatus.FINISHED_ERROR,
            f"{STEP_FAILED}: {type(exc).__name__}: {exc}")
        changed = self.scheduler.update(scheduler_output, ModelRunnerOutput())
        return self._process(failed + changed)

    def _publish_kv_events(self) -> None:
        """Send this step's block-pool events (one batch) to the publisher thread."""
        kv = self.scheduler.kv_cache_manager
        events = to_wire_events(kv.take_events())
        if self.kv_store is not None:
            events += self.kv_store.take_events()
        self.event_publisher.publish(events)

    def _process(self, changed: list[Request]) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        for request in changed:
            group_id = request.parent_id or request.request_id
            group = self._groups.get(group_id)
            if group is None:
                continue
            touched[group_id] = group
            self._apply(group, request, now)
        outputs = []
        for group_id, group in touched.items():
            outputs.append(group.output())
            if group.finished:
                del self._groups[group_id]
        return outputs

    def _apply(self, group: _Group, request: Request, now: float) -> None:
        index = request.sample_index
        completion = group.completions.get(index)
        if completion is None:
            completion = group.completions[index] = CompletionOutput(index=index)
            params = request.sampling_params
            group.detokenizers[index] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.stop_strings,
                params.skip_special_tokens, params.include_stop_str_in_output)
            if params.logprobs is not None:
                completion.logprobs = []
                completion.cumulative_logprob = 0.0
        group.num_cached_tokens = max(request.num_cached_tokens, 0)
        if group.first_scheduled_time is None:
            group.first_scheduled_time = request.first_scheduled_time
        group.num_preemptions = max(group.num_preemptions, request.num_preemptions)
        if (request.wants_prompt_logprobs and index == 0 and
                len(group.prompt_logprobs or ()) != len(request.prompt_logprobs) + 1):
            group.prompt_logprobs = [None, *request.prompt_logprobs]
        if request.status == RequestStatus.FINISHED_ERROR:
            group.error = request.error
        new_tokens = request.output_token_ids[len(completion.token_ids):]
        if new_tokens and group.first_token_time is None:
            group.first_token_time = now
        self.generation_tokens_total += len(new_tokens)
        completion.token_ids.extend(new_tokens)
        if completion.logprobs is not None:
            for i in range(len(completion.logprobs), len(request.output_logprobs)):
                entry = request.output_logprobs[i]
                completion.logprobs.append(entry)
                completion.cumulative_logprob += entry.get(request.output_token_ids[i], 0.0)
        detokenizer = group.detokenizers[index]
        stop = detokenizer.update(new_tokens) if new_tokens else None
        if stop is not None and not request.is_finished:
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
        if request.is_finished:
            detokenizer.flush()
            completion.finish_reason = request.status.value
            completion.stop_reason = request.stop_reason
        completion.text = detokenizer.text

    # ---- introspection ------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        kv = sched.kv_cache_manager
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + len(sched.loading),
            num_swapped=len(sched.swapped), kv_cache_usage=kv.usage,
            num_blocks=kv.num_usable_blocks, num_free_blocks=kv.num_free_blocks,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits, num_preemptions=sched.num_preemptions,
            num_swaps=sched.num_swaps, num_pinned_blocks=kv.num_pinned_blocks,
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total,
            num_waiting_for_kv=len(sched.loading),
            iteration_token_counts=self.iteration_tokens.snapshot()[0],
            iteration_tokens_sum=self.iteration_tokens.snapshot()[1],
            kv_store_tiers=() if self.kv_store is None else tuple(
                t.to_dict() for t in self.kv_store.snapshot_stats()))

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
