"""The n-gram proposer (prompt lookup, vLLM's `NgramProposer`): find the request's last n
tokens earlier in its prompt + output, longest n first (`prompt_lookup_max` down to
`prompt_lookup_min`), and propose the k tokens that followed that occurrence (the most recent
one). No model: a proposal costs a scan of the request's tokens."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.spec.config import SpeculativeConfig


def find_ngram_continuation(tokens: Sequence[int], n: int, k: int) -> list[int]:
    """The up to `k` tokens after the most recent earlier occurrence of the last `n` tokens
    of `tokens` ([] when there is none). An occurrence overlapping the suffix counts."""
    size = len(tokens)
    if n <= 0 or size <= n:
        return []
    suffix = list(tokens[size - n:])
    last = suffix[-1]
    # Candidate end positions of an earlier occurrence: where its last token sits.
    for end in range(size - 2, n - 2, -1):
        if tokens[end] == last and list(tokens[end - n + 1:end + 1]) == suffix:
            return list(tokens[end + 1:end + 1 + k])
    return []


class NgramProposer:
    """Proposes up to `num_speculative_tokens` tokens by prompt lookup (module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """At most min(k, `max_tokens`) proposed tokens to follow `tokens`."""
        k = min(self.k, max_tokens)
        if k <= 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            proposal = find_ngram_continuation(tokens, n, k)
            if proposal:
                return proposal
        return []
