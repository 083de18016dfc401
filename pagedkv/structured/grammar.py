"""StructuredOutputGrammar: one request's position in its grammar (an xgrammar matcher)."""

from __future__ import annotations

from typing import Any

from pagedkv.structured.errors import clean_grammar_error


class StructuredOutputGrammar:
    """Which tokens may come next, advanced token by token as the request's tokens are accepted.

    The scheduler advances it (`accept_token`) when a sampled token is appended and finishes the
    request once `is_terminated()`; the sampler reads it (`fill_bitmask`) for the next token.
    For `n > 1`, each sample continues from a `fork()` taken before its first token.

    A grammar-engine failure never escapes to the batch: `fill_bitmask` and `accept_token` catch
    it, record a client-readable message in `error` (None while healthy) and leave the row
    unconstrained; the scheduler then ends this request alone with that error.
    """

    def __init__(self, matcher: Any, vocab_size: int, allowed_mask: Any = None) -> None:
        """`allowed_mask`: an optional bitmask row (int32) ANDed into every filled row."""
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._allowed_mask = allowed_mask
        self.error: str | None = None

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) when the grammar forbids it or the
        grammar engine failed (then `error` says why)."""
        if self.error is not None:
            return False
        try:
            return bool(self._matcher.accept_token(token_id))
        except Exception as exc:  # a grammar-engine failure ends only this request
            self.error = f"structured-output grammar failed: {clean_grammar_error(exc)}"
            return False

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of an xgrammar bitmask (CPU int32).
        On a grammar-engine failure (a terminated grammar asked again, say) the row allows
        every token and `error` is set."""
        try:
            if self.error is None:
                self._matcher.fill_next_token_bitmask(bitmask, row)
                if self._allowed_mask is not None:
                    bitmask[row] &= self._allowed_mask
                return
        except Exception as exc:
            self.error = f"structured-output grammar failed: {clean_grammar_error(exc)}"
        bitmask[row] = -1

    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""
        return bool(self._matcher.is_terminated())

    def fork(self) -> StructuredOutputGrammar:
        """An independent copy of this state."""
        return StructuredOutputGrammar(self._matcher.fork(), self.vocab_size, self._allowed_mask)
