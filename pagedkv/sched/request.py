"""Request: one sequence's state as the scheduler and the KV manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedkv.kv.block_table import BlockIdTable
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.structured.grammar import StructuredOutputGrammar


def child_request_id(parent_id: str, index: int) -> str:
    """Id of sample `index` (>= 1) of an `n > 1` request; sample 0 keeps the parent's id.

    The engine refuses a new request whose id (or one of its children's) is already live, so
    a child id never clashes; the sampler keys each child's random stream by this id.
    """
    return f"{parent_id}#{index}"


class RequestStatus(enum.Enum):
    """Where a request is: WAITING (queued, holds no blocks unless a prefix-cache hit is being
    admitted), RUNNING (holds device blocks), SWAPPED (holds host blocks only), PREEMPTED
    (blocks freed for recompute, back in the waiting queue), or one of the FINISHED_* states
    (blocks freed; the value is the OpenAI finish_reason). Set only by the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    PREEMPTED = "preempted"  # freed for recompute, back in the waiting queue
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # holds blocks the KV store loads into
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # e.g. the KV cache can never hold it

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


# A tuple: `in` compares enum members by identity in C (a frozenset would hash them in Python).
FINISHED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


@dataclass(eq=False)
class Request:
    """A single sequence. `all_token_ids` is prompt + output and grows as tokens are sampled.

    `num_computed_tokens` counts tokens whose K/V sit in the KV cache (cached prefix included).
    `num_cached_tokens` is the prefix-cache hit at first admission (-1 until admitted).
    For `n > 1`, the engine forks children that share `parent_id` and differ in `sample_index`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    parent_id: str | None = None
    sample_index: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.output_logprobs: list[dict[int, float]] = []
        # Entry i: logprobs of prompt token i + 1 (from the logits at position i).
        self.prompt_logprobs: list[dict[int, float]] = []
        # The grammar state of a structured-output request (set by the engine), else None.
        self.structured_output: StructuredOutputGrammar | None = None
        # `bad_words` as token-id sequences (set by the engine, which has the tokenizer).
        self.bad_words_token_ids: list[list[int]] = []
        self.first_scheduled_time: float | None = None  # time.monotonic() at first admission
        # The KV store's lookup while waiting: (first block, blocks held from there), or None.
        self.kv_store_lookup: tuple[int, int] | None = None
        # What the engine core already sent the frontend (it sends only what is new).
        self.num_output_reported = 0
        self.num_prompt_logprobs_reported = 0
        self.reported_scheduled = False
        # Scheduled but not yet applied by `Scheduler.update` (only while a step runs and the
        # next is built: overlapped scheduling): tokens, and samples whose tokens are unknown.
        self.num_tokens_ahead = 0
        self.num_placeholders = 0
        # Speculative decoding: the draft tokens proposed to follow `all_token_ids` (set after
        # each step that changed them; [] when none), verified when next scheduled.
        self.spec_token_ids: list[int] = []
        # The two ScheduledRequests the scheduler reuses in turn for this request.
        self.scheduled_slots: list = [None, None]
        # Their block ids, each kept up to date incrementally (kv/block_table.py).
        self.block_id_tables = (BlockIdTable(), BlockIdTable())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
