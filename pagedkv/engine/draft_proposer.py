"""The draft-model proposer (`speculative_config` method "draft_model"): a second, smaller
model over the target's vocab proposes k tokens per request greedily, from its own paged KV
cache (its own ModelRunner and KV manager, built by engine/compose.py).

Each call first catches the draft's KV up with the tokens it has not seen (the whole prompt on
first use, then the run the target emitted) in one forward pass for the batch, which also gives
the first draft token; then k - 1 decode steps for the batch give the rest. The draft KV of a
proposal the target rejected is rolled back on the next call: the request's computed length
drops to the prefix it shares with the request's tokens and the blocks past it are freed.
Greedy drafts are one-hot draft distributions, so the verifier's rejection rule
(spec/rejection.py) keeps the target's distribution exactly.

A request whose draft KV does not fit the draft's cache gets no proposal this step (it decodes
one token as usual) and its draft state is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.kv.interface import KVCacheManagerAPI
    from pagedkv.model.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class DraftSequence:
    """One request's tokens as the draft's KV manager sees them (a `KVRequest`)."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def shared_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`."""
    n = min(limit, len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    """Proposes up to `k` tokens per request with `runner` (the draft model) over the blocks
    of `kv` (the draft's own KV manager); see the module docstring."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManagerAPI, k: int) -> None:
        self.runner = runner
        self.kv = kv
        self.k = k
        self._seqs: dict[str, DraftSequence] = {}

    @property
    def num_blocks(self) -> int:
        """The draft's KV cache blocks (null block included)."""
        return self.kv.num_usable_blocks + 1

    @property
    def block_bytes(self) -> int:
        return self.runner.kv_cache_spec.page_size_bytes

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def propose_batch(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """Up to min(k, max) greedy draft tokens for each (request id, tokens, max)."""
        seqs = [self._catch_up_sequence(rid, tokens) for rid, tokens, _ in requests]
        wanted = {rid: min(self.k, room) for rid, _, room in requests}
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
        step = [(seq, seq.all_token_ids[seq.num_computed_tokens:]) for seq in seqs]
        while True:
            step = [(seq, new) for seq, new in step
                    if len(drafts[seq.request_id]) < wanted[seq.request_id]
                    and self._allocate(seq, len(new))]
            if not step:
                break
            sampled = self._run(step)
            next_step = []
            for seq, new in step:
                seq.num_computed_tokens += len(new)
                token = sampled[seq.request_id][0]
                drafts[seq.request_id].append(token)
                seq.all_token_ids.append(token)
                next_step.append((seq, [token]))
            step = next_step
        return [drafts[rid] for rid, _, _ in requests]

    def _catch_up_sequence(self, request_id: str, tokens: list[int]) -> DraftSequence:
        """`request_id`'s draft sequence set to `tokens`, its KV rolled back to the prefix it
        shares with them (the drafts the target rejected, and the last token: recomputed so
        the forward pass has a position to sample from)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = DraftSequence(request_id,
                                                          num_prompt_tokens=len(tokens))
        keep = shared_prefix(seq.all_token_ids, tokens,
                             min(seq.num_computed_tokens, len(tokens) - 1))
        seq.all_token_ids = list(tokens)
        if keep < seq.num_computed_tokens:
            seq.num_computed_tokens = keep
            self.kv.trim_blocks(seq, keep)
        return seq

    def _allocate(self, seq: DraftSequence, num_new: int) -> bool:
        """Slots for `num_new` more tokens of `seq`; False (its state dropped) when the
        draft's cache has no room."""
        if self.kv.allocate_slots(seq, num_new) is not None:
            return True
        self.forget(seq.request_id)
        return False

    def _run(self, step: list[tuple[DraftSequence, list[int]]]) -> dict[str, list[int]]:
        """One draft forward pass over each sequence's new tokens: its greedy next token."""
        out = SchedulerOutput(scheduled=[
            ScheduledRequest(request_id=seq.request_id, token_ids=new,
                             start_pos=seq.num_computed_tokens,
                             block_table=self.kv.get_block_ids(seq.request_id),
                             sampling_params=GREEDY)
            for seq, new in step])
        out.total_num_scheduled_tokens = sum(len(new) for _, new in step)
        return self.runner.execute(out).sampled_token_ids


def draft_facts(proposer: object) -> dict[str, int]:
    """What the start-up banner and /kv_cache_info say of a draft model's KV cache (nothing
    without one)."""
    if not isinstance(proposer, DraftModelProposer):
        return {}
    return {"draft_num_blocks": proposer.num_blocks, "draft_block_bytes": proposer.block_bytes}


def shutdown_draft(proposer: object) -> None:
    """Free a draft model's weights and KV cache (nothing for any other proposer)."""
    if isinstance(proposer, DraftModelProposer):
        proposer.runner.shutdown()
