"""LLMEngine: the frontend (tokenizer, input checks, detokenizer, stop strings, cumulative
outputs) over an engine core (scheduler + KV manager + model runner), one `step()` at a time.

    add_request -> InputProcessor -> EngineCoreRequest -> core
    step        -> core step -> CoreOutputs (new tokens) -> OutputProcessor -> RequestOutputs

The core runs in this process (the default: offline `LLM`, tests) or in its own process
(`core_process=True`, what `pagedkv serve` uses): the same messages cross either way
(pagedkv/engine/messages.py). Not thread-safe: one thread owns an engine (the server runs it in
a background thread); `wake()` alone may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.core_client import InprocCoreClient
from pagedkv.engine.dp_client import start_client
from pagedkv.engine.input_processor import InputProcessor, PromptType
from pagedkv.engine.messages import Abort, EngineCoreRequest, EngineReady
from pagedkv.engine.model_files import open_model_dir
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.stats import EngineStats
from pagedkv.kv.hashing import RequestBlockHasher
from pagedkv.kv.pins import PinInfo
from pagedkv.sched.request import child_request_id
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sched.validation import check_cache_salt, check_priority

if TYPE_CHECKING:
    from pagedkv.structured.backend import XGrammarBackend

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    """The engine. See module docstring; `step()` returns cumulative outputs of the requests
    that progressed (got tokens or finished) in that step."""

    def __init__(self, args: EngineArgs, *, core_process: bool = False) -> None:
        args.validate()
        if not args.model:
            raise ValueError("model must be a model directory, got ''")
        self.tokenizer = open_model_dir(args)  # args.model: now a checked local directory
        self.args = args
        self.client = start_client(args, self.tokenizer, core_process=core_process)
        # The core itself when it runs in this process (tests and tools), else None.
        self.core = self.client.core if isinstance(self.client, InprocCoreClient) else None
        ready = self.client.ready
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.num_gpu_blocks = ready.num_gpu_blocks
        self.kv_cache_dtype = ready.kv_cache_dtype  # resolved: "auto" is the model's dtype
        self.block_bytes = ready.block_bytes
        self.eos_token_ids = tuple(ready.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, ready)
        self.outputs = OutputProcessor(self.tokenizer)
        self._structured_backend: XGrammarBackend | None = None
        self._structured_lock = threading.Lock()
        self._shut_down = False

    # ---- the in-process core's parts (tests and tools; None with a core process) --------

    @property
    def scheduler(self) -> Any:
        return self._local("scheduler")

    @property
    def runner(self) -> Any:
        return self._local("runner")

    @runner.setter
    def runner(self, runner: Any) -> None:
        if self.core is None:
            raise AttributeError("the engine core runs in its own process")
        self.core.runner = runner

    @property
    def kv_store(self) -> Any:
        return self._local("kv_store")

    @property
    def event_publisher(self) -> Any:
        return self._local("event_publisher")

    @property
    def kv_setup(self) -> Any:
        return self._local("kv_setup")

    @property
    def model_config(self) -> Any:
        return self._local("model_config")

    @property
    def ready(self) -> EngineReady:
        """What the core said of itself when it started (sizes, the cache's resolved format,
        the model's dtype and device): fixed, so any thread may read it."""
        return self.client.ready

    def _local(self, name: str) -> Any:
        return None if self.core is None else getattr(self.core, name)

    @property
    def is_shut_down(self) -> bool:
        return self._shut_down

    def shutdown(self) -> None:
        """Abort every request and stop the core (its KV store saver, the KV-event publisher,
        and the model runner's device memory: KV cache, CUDA graphs, weights). Idempotent;
        the engine cannot step afterwards."""
        if self._shut_down:
            return
        self._shut_down = True
        self.outputs.groups.clear()
        self.client.shutdown()
        if self._structured_backend is not None:
            self._structured_backend.close()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, core_process: bool = False) -> LLMEngine:
        return cls(args, core_process=core_process)

    def is_alive(self) -> bool:
        """False once the core is gone (its process died, or shut down)."""
        return not self._shut_down and self.client.is_alive()

    def wake(self) -> None:
        """Cut short a `step()` that waits for a core process (any thread)."""
        self.client.wake()

    # ---- requests -----------------------------------------------------------------------

    @property
    def structured_output_backend(self) -> XGrammarBackend:
        """The grammar compiler of this engine's tokenizer, built on first use (importing
        xgrammar is slow). Thread-safe; its `compile` may be called from any thread."""
        if self.core is not None:
            return self.core.structured_output_backend
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
        if self.core is not None:
            return self.core._structured_backend
        return self._structured_backend

    def truncate_prompt(self, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last `truncate_prompt_tokens` ids (-1: the most that leave room for one
        generated token; None: all), as vLLM truncates from the left."""
        return self.inputs.truncate_prompt(ids, truncate_prompt_tokens)

    def tokenize_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                        ) -> tuple[str | None, list[int]]:
        """Return (prompt text or None, prompt token ids), keeping only the last
        `truncate_prompt_tokens` ids when given; raises ValueError for bad prompts."""
        return self.inputs.tokenize_prompt(prompt, truncate_prompt_tokens)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError when this prompt with `params.n` samples can never fit in the cache."""
        self.inputs.check_fits(num_prompt_tokens, params)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (vLLM's two spellings)."""
        return self.inputs.bad_words_token_ids(words)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError for a bad prompt, priority or cache_salt, a
        duplicate id, or a prompt whose `params.n` samples can never fit in the KV cache."""
        if self._shut_down:
            raise RuntimeError("the engine was shut down")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_id_free(request_id, params.n)
        if params.use_beam_search and self.args.async_scheduling:
            raise ValueError("use_beam_search cannot run with async_scheduling")
        check_cache_salt(cache_salt)
        check_priority(priority)
        self.inputs.check_token_ids(params)
        text, ids = self.inputs.tokenize_prompt(prompt, params.truncate_prompt_tokens)
        self.inputs.check_fits(len(ids), params)
        if params.structured_outputs is not None and self.core is None:
            self.structured_output_backend.grammar(params.structured_outputs)  # ValueError here
        arrival = time.monotonic() if arrival_time is None else arrival_time
        bad_words = self.inputs.prepare_bad_words(params)
        self.client.add_request(EngineCoreRequest(
            request_id, ids, params, arrival, priority, cache_salt, bad_words))
        self.outputs.add_group(request_id, text, ids, params, arrival)

    def _check_id_free(self, request_id: str, n: int) -> None:
        """Raise ValueError if `request_id` or the ids of its samples 1..n-1 are taken."""
        groups = self.outputs.groups
        ids = [request_id] + [child_request_id(request_id, i) for i in range(1, n)]
        clash = next((i for i in ids if i in groups), None)
        if clash is None and "#" in request_id:  # may name a sample of a live request
            parent, _, index = request_id.rpartition("#")
            group = groups.get(parent)
            if group is not None and index.isdigit() and 0 < int(index) < group.params.n:
                clash = request_id
        if clash is not None:
            raise ValueError(f"request id {clash!r} is already in use")

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (all their samples); their blocks go back at once. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        sample_ids = []
        for rid in ids:
            group = self.outputs.pop_group(rid)
            if group is not None:
                sample_ids += [rid] + [child_request_id(rid, i) for i in range(1, group.params.n)]
        if sample_ids:
            self.client.abort(Abort(sample_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.groups)

    # ---- pinned prefixes ----------------------------------------------------------------

    def prefix_ids(self, prompt: PromptType, cache_salt: str | None = None) -> list[int]:
        """`prompt`'s token ids as the pin calls take them (`cache_salt` checked). ValueError
        for a bad prompt or salt. Reads only the tokenizer: any thread may call it."""
        check_cache_salt(cache_salt)
        return self.inputs.tokenize_prompt(prompt)[1]

    def is_prefix_cached(self, prompt: PromptType, cache_salt: str | None = None) -> bool:
        """Whether every full block of `prompt` (salted and hashed as a request's would be) is
        in the device prefix cache now. ValueError for a bad prompt or salt, or a prompt
        shorter than one block."""
        return self.client.call("is_prefix_cached", self.prefix_ids(prompt, cache_salt), cache_salt)

    def pin_prefix(self, prompt: PromptType, cache_salt: str | None = None) -> PinInfo:
        """Pin the leading run of `prompt`'s full blocks that is in the device prefix cache now
        (salted and hashed as a request's): no policy evicts them until `unpin_prefix`, and
        `reset_prefix_cache` keeps them. Computes nothing: `LLM.pin_prefix` and the server's
        /v1/pin run the prompt first when it is not cached. Pinning the same prompt again
        replaces its pin. ValueError for a bad prompt or salt, a prompt shorter than one block,
        or more pinned blocks than `max_pinned_fraction` of the cache."""
        return self.client.call("pin_prefix", self.prefix_ids(prompt, cache_salt), cache_salt)

    def unpin_prefix(self, prompt: PromptType, cache_salt: str | None = None) -> PinInfo:
        """Release `prompt`'s pin: its blocks stay cached and become evictable again.
        `pagedkv.kv.pins.NotPinnedError` (a ValueError) when it is not pinned."""
        return self.client.call("unpin_prefix", self.prefix_ids(prompt, cache_salt), cache_salt)

    # ---- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step: schedule, run the model (block moves, forward pass, sampling),
        apply the sampled tokens, detokenize. With a core process: take the outputs of the
        core's steps that arrived (waiting a little for some).

        Returns one cumulative `RequestOutput` per request group that progressed or finished
        (a new object each step: it stays valid, and never changes, after later steps); a
        finished group is forgotten after its last output. [] when there was nothing to do.
        """
        if self._shut_down:
            raise RuntimeError("the engine was shut down")
        core_outputs = self.client.get_outputs()
        outputs, stops = self.outputs.process(core_outputs, self.client.output_time())
        for sample_id, stop in stops:
            self.client.abort(Abort([sample_id], "stop", stop))
        return outputs

    # ---- introspection ------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        return self.client.call("get_stats")

    def check_invariants(self) -> None:
        self.client.call("check_invariants")

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run the core's utility call `method` (pagedkv/engine/utility.py) between its steps,
        in-process or in the core process alike, and return its result. Only the thread that
        steps the engine may call it; ValueError for an unknown method."""
        return self.client.call(method, *args)

    def start_utility(self, method: str, *args: Any) -> Future:
        """`call_utility` without waiting: the call's `concurrent.futures.Future`, resolved
        (with its result, or its ValueError / NotPinnedError) by a later `step()` of this
        thread, or at once with the core in-process; failed with CoreDeadError if the core
        dies. Only the thread that steps the engine may call it (the future's done-callbacks
        run in that thread)."""
        return self.client.call_async(method, *args)

    def has_pending_calls(self) -> bool:
        """Whether a started utility call waits for its answer (`step()` receives it)."""
        return self.client.has_pending_calls()

    def block_hasher(self) -> RequestBlockHasher:
        """A hasher of prompt blocks as the core's KV cache hashes them (its block size, the
        engine's hash algorithm), for the frontend's own use (the request log)."""
        return RequestBlockHasher(self.args.prefix_caching_hash_algo, self.client.ready.block_size)

    def core_busy_for(self) -> float:
        """Seconds a core process has spent in its current step (0.0 while it is idle, and
        always with the core in-process, whose steps the stepping thread times itself). Any
        thread may call it."""
        return self.client.busy_for()

    @property
    def prompt_tokens_total(self) -> int:
        """Prompt tokens added so far (read from the in-process core as is; a core process
        answers a utility call, so only the thread that steps the engine may ask it)."""
        if self.core is not None:
            return self.core.prompt_tokens_total
        return self.get_stats().prompt_tokens

    @property
    def generation_tokens_total(self) -> int:
        """Tokens generated so far (as `prompt_tokens_total`)."""
        if self.core is not None:
            return self.core.generation_tokens_total
        return self.get_stats().generation_tokens
