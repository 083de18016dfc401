"""The wire between the frontend (tokenizer, detokenizer, HTTP) and the engine core (scheduler,
KV manager, model runner): msgspec structs, the same objects in-process and across processes.

    frontend -> core:  EngineCoreRequest, Abort (end samples: aborted, or stopped by a stop
                       string the frontend found), UtilityCall (stats, pins, invariants, stop)
    core -> frontend:  EngineReady once, then CoreStepOutputs per step, UtilityResult per call,
                       CoreDied when the core's loop fails

Across processes they travel msgpack-encoded over ZMQ (`encode` / `decode` below); in-process the
client passes the objects themselves, so the tests of one mode exercise the other's meaning.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec

from pagedkv.config.errors import ErrorKind
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.structured.params import StructuredOutputsParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request as the core takes it: prompt already tokenized, bad words as token ids."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # SamplingParams (a dict on the wire: see `params_from_wire`)
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] = []


class Abort(msgspec.Struct, array_like=True, tag=True):
    """End these sample ids with `status` ("abort", or "stop" for a stop string) and free
    their blocks. Unknown ids are ignored."""

    request_ids: list[str]
    status: str = "abort"
    stop_reason: str | None = None


class UtilityCall(msgspec.Struct, array_like=True, tag=True):
    """Call `EngineCore.<method>(*args)` between steps; answered by a UtilityResult."""

    call_id: int
    method: str
    args: list[Any] = []


class CoreInput(msgspec.Struct, array_like=True, tag=True):
    """A new request (the only frontend -> core message besides Abort and UtilityCall)."""

    request: EngineCoreRequest


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What happened to one sample in one step: only what is new.

    `new_logprobs` has one entry per new token (when the request asked for logprobs);
    `prompt_logprobs` is the whole list so far, sent only when it changed. `finish_reason` is
    set once, on the sample's last output; `error` explains a finish_reason "error", and
    `error_kind` says whose fault it was (`ErrorKind`: the request's, or the model step's).
    """

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    prompt_logprobs: list[dict[int, float]] | None = None
    parent_id: str | None = None
    sample_index: int = 0


class CoreStepOutputs(msgspec.Struct, array_like=True, tag=True):
    """One core step's outputs, in schedule order, when the step ended (the core's
    `time.monotonic()`: one clock for every process on the machine) and the core's load then."""

    outputs: list[CoreOutput]
    timestamp: float = 0.0
    # The core's queues and KV usage after the step (what a data-parallel front end places by).
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0


class UtilityResult(msgspec.Struct, array_like=True, tag=True):
    """The answer to UtilityCall `call_id`: `result`, or an exception's type name and text."""

    call_id: int
    result: Any = None
    error_type: str | None = None
    error: str | None = None


class EngineReady(msgspec.Struct, array_like=True, tag=True):
    """The facts the frontend needs, sent once when the core is built (instead of the frontend
    reaching into the core's objects)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_usable_blocks: int
    watermark_blocks: int
    num_gpu_blocks: int
    eos_token_ids: list[int]
    kv_cache_dtype: str  # the cache's resolved format ("auto" named: the model's dtype)
    block_bytes: int  # one block's bytes on the device (every layer; int8's scales included)
    # What the start-up banner says (pagedkv/server/banner.py): blocks one request of
    # max_model_len tokens holds at most, the weights' dtype, bytes and device, and what runs
    # the CPU model's hot ops ("" off CPU).
    max_blocks_per_request: int = 0
    model_dtype: str = ""
    weights_bytes: int = 0
    device: str = ""
    cpu_kernels: str = ""
    malloc: str = ""  # the core process's malloc on CPU: "tcmalloc" or "glibc" ("" off CPU)
    # A draft model's own KV cache (speculative_config method "draft_model"; 0: none).
    draft_num_blocks: int = 0
    draft_block_bytes: int = 0
    kv_budget: str = ""  # which rule sized the KV cache, with its figures (KVCacheSetup.budget)


class CoreDied(msgspec.Struct, array_like=True, tag=True):
    """The core failed to start (`error_type`: the exception's class name) or its loop
    failed; the process is exiting."""

    reason: str
    error_type: str | None = None


FrontendMessage = CoreInput | Abort | UtilityCall
CoreMessage = CoreStepOutputs | UtilityResult | EngineReady | CoreDied

_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.init)
_SO_FIELDS = tuple(f.name for f in fields(StructuredOutputsParams) if f.init)


def params_from_wire(value: Any) -> SamplingParams:
    """SamplingParams from what msgspec made of one (a dict of all its fields); the object
    itself passes through (the in-process client sends objects)."""
    if isinstance(value, SamplingParams):
        return value
    value = {k: v for k, v in value.items() if k in _PARAM_FIELDS}  # msgspec sends every field
    so = value.get("structured_outputs")
    if so is not None:
        value["structured_outputs"] = StructuredOutputsParams(
            **{k: v for k, v in so.items() if k in _SO_FIELDS})
    if value.get("logit_bias") is not None:  # msgpack map keys come back as ints already
        value["logit_bias"] = {int(k): v for k, v in value["logit_bias"].items()}
    return SamplingParams(**value)


class Codec:
    """msgpack encoders/decoders for one side of the wire (not thread-safe: one per thread)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._frontend = msgspec.msgpack.Decoder(FrontendMessage)
        self._core = msgspec.msgpack.Decoder(CoreMessage)

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def decode_frontend(self, data: bytes) -> FrontendMessage:
        return self._frontend.decode(data)

    def decode_core(self, data: bytes) -> CoreMessage:
        return self._core.decode(data)
