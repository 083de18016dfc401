"""The n-gram proposer (prompt lookup, vLLM's `NgramProposer`): find the request's last n
tokens earlier in its prompt + output, longest n first (`prompt_lookup_max` down to
`prompt_lookup_min`), and propose the k tokens that followed that occurrence (the most recent
one). No model: a proposal costs a scan of the request's tokens."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from pagedkv.spec.config import SpeculativeConfig

ITEM_BYTES = array("q").itemsize


def find_ngram_continuation(tokens: Sequence[int], n: int, k: int) -> list[int]:
    """The up to `k` tokens after the most recent earlier occurrence of the last `n` tokens
    of `tokens` ([] when there is none). An occurrence overlapping the suffix counts. The
    search runs over the tokens' bytes (`bytes.rfind`, in C); a hit not on a token boundary
    is skipped."""
    size = len(tokens)
    if n <= 0 or size <= n:
        return []
    data = array("q", tokens).tobytes()
    width = ITEM_BYTES
    needle = data[(size - n) * width:]
    end = (size - 1) * width  # an earlier occurrence ends before the last token
    while True:
        at = data.rfind(needle, 0, end)
        if at < 0:
            return []
        if at % width == 0:
            start = at // width + n
            return list(tokens[start:start + k])
        end = at + len(needle) - 1  # the next candidate starts before this one


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
