"""SpecDecodeStats: speculative decoding's cumulative counters, vLLM's
(`vllm:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`,
`_num_accepted_tokens_per_pos`). Mutated by the scheduler when it applies a verified step."""

from __future__ import annotations


class SpecDecodeStats:
    """`num_drafts`: verified proposals; `num_draft_tokens`: their tokens; `num_accepted_tokens`:
    the draft tokens the target accepted; `accepted_per_pos[i]`: drafts whose token i (0-based)
    was accepted (a prefix is accepted, so the entries never grow with i)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified proposal of `num_draft_tokens` tokens, the first `num_accepted` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
