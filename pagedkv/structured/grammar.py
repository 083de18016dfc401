"""StructuredOutputGrammar: one request's position in its grammar (an xgrammar matcher)."""

from __future__ import annotations

from typing import Any


class StructuredOutputGrammar:
    """Which tokens may come next, advanced token by token as the request's tokens are accepted.

    The scheduler advances it (`accept_token`) when a sampled token is appended and finishes the
    request once `is_terminated()`; the sampler reads it (`fill_bitmask`) for the next token.
    For `n > 1`, each sample continues from a `fork()` taken before its first token.
    """

    def __init__(self, matcher: Any, vocab_size: int, allowed_mask: Any = None) -> None:
        """`allowed_mask`: an optional bitmask row (int32) ANDed into every filled row."""
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._allowed_mask = allowed_mask

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar forbids it."""
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of an xgrammar bitmask (CPU int32)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._allowed_mask is not None:
            bitmask[row] &= self._allowed_mask

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())

    def fork(self) -> StructuredOutputGrammar:
        """An independent copy of this state."""
        return StructuredOutputGrammar(self._matcher.fork(), self.vocab_size, self._allowed_mask)
