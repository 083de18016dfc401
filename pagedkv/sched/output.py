"""What the scheduler hands the model runner each step, and what the runner hands back.

The runner applies, in this order: `blocks_to_swap_out` (device -> host), `blocks_to_swap_in`
(host -> device), `blocks_to_copy` (device -> device, copy-on-write), then runs the forward pass
over `scheduled` and samples for the requests whose `num_samples > 0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.structured.grammar import StructuredOutputGrammar


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    `token_ids` are the tokens whose K/V this step computes: positions `start_pos ..
    start_pos + len(token_ids) - 1`. `block_table` is the request's full list of physical device
    block ids (logical block i -> block_table[i]); slot of position p is
    `block_table[p // block_size] * block_size + p % block_size`.
    `num_samples` is 0 for a prefill chunk that does not reach the end of the prompt, 1 for a
    normal step, and `n` for the step that finishes the prompt of a request with `n > 1`
    (the runner samples `n` tokens from the same logits, sample i with generator seed + i).
    `prompt_token_ids` and `output_token_ids` are the request's tokens so far (penalties use them).
    `banned_token_ids` must not be sampled this step: eos and stop tokens while the request is
    below `min_tokens`.
    `num_prompt_logprob_rows` leading positions of this chunk need logits for prompt logprobs
    (position p gives the logprob of prompt token p + 1; 0 unless the request asked for them).

    The scheduler reuses two of these per request in turn (`ScheduledRequestCache`), so one
    stays valid, unchanged, for one more `schedule()`: the step the runner may still be
    running while the next is built (overlapped scheduling).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sampling_params: SamplingParams
    num_samples: int = 1
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    sample_index: int = 0
    banned_token_ids: tuple[int, ...] = ()
    num_prompt_logprob_rows: int = 0
    # The request's grammar state when its output is constrained and it samples this step: the
    # sampler only reads it (allowed next tokens); the scheduler advances it after the step.
    grammar: StructuredOutputGrammar | None = None
    # Models mixing attention types (hybrid KV cache groups, kv/coordinator.py): every group's
    # block table, in group order (`block_table` is group 0's); None with one group.
    group_block_tables: list[list[int]] | None = None
    # Speculative decoding: the draft tokens this step verifies, `token_ids[1:]` (the runner
    # computes logits at all of `token_ids`' positions and returns the accepted run plus the
    # target's next token: 1 to len(spec_token_ids) + 1 tokens); [] for a plain step.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's work, built by `Scheduler.schedule` and consumed by `ModelRunner.execute`.

    The block-move lists are (source id, destination id) pairs to apply in the order in the
    module docstring; `scheduled` lists the requests whose tokens run, in schedule order.
    Block ids are valid for this step only: the next `schedule()` may free and reuse them.
    The runner reads it and mutates nothing in it.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended since the last step; the runner drops their per-request state
    # (sampling generators) when it sees them.
    finished_request_ids: list[str] = field(default_factory=list)
    # Requests whose blocks move between device and host this step (swap out or in): with the
    # scheduled ones, the requests a failed step leaves with unknown KV contents.
    swapped_request_ids: list[str] = field(default_factory=list)
    # The KV store's work for this step (pagedkv.store.connector.StoreConnectorMetadata), None
    # when it has none: loads to start, apply or wait for make a step non-empty.
    kv_connector_metadata: object | None = None
    # vLLM's total_num_scheduled_tokens: the tokens of `scheduled`, summed.
    total_num_scheduled_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.blocks_to_copy or self.kv_connector_metadata is not None)


@dataclass
class ModelRunnerOutput:
    """`sampled_token_ids[request_id]` lists `num_samples` tokens for each sampling request
    (a request verifying draft tokens: the tokens it emits, each with its logprobs entry).

    `logprobs[request_id][i]` (only when the request asked for logprobs) maps token id ->
    log-probability for sample i: the top-N tokens plus the sampled one.
    `prompt_logprobs[request_id][j]` is the same for prompt token `start_pos + j + 1` (only for
    requests scheduled with `num_prompt_logprob_rows > 0`).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
