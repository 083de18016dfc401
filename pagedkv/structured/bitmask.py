"""Masking a batch's logits with the grammars of its structured-output requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.structured.grammar import StructuredOutputGrammar


def apply_grammar_bitmask(logits: torch.Tensor,
                          grammars: Sequence[StructuredOutputGrammar | None]) -> torch.Tensor:
    """`logits` [R, V] with the tokens each row's grammar forbids at -inf (row r has
    `grammars[r]`; None rows are left alone). One bitmask for the whole batch, filled on the
    CPU by xgrammar and applied in place to a copy; `logits` itself when no row has a grammar."""
    rows = [r for r, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)
    for r in rows:
        grammars[r].fill_bitmask(bitmask, r)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=vocab, indices=rows)
    return out
