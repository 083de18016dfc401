"""Masking a batch's logits with the grammars of its structured-output requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.structured.grammar import StructuredOutputGrammar


def apply_grammar_bitmask(logits: torch.Tensor,
                          grammars: Sequence[StructuredOutputGrammar | None],
                          unbanned: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` [R, V] with the tokens each row's grammar forbids at -inf (row r has
    `grammars[r]`; None rows are left alone). One bitmask for the whole batch, filled on the
    CPU by xgrammar and applied in place to a copy; `logits` itself when no row has a grammar.

    `unbanned`: the same rows before the eos/stop-token bans (`min_tokens`, `bad_words`). A row
    whose grammar allows only banned tokens (a complete grammar whose one way on is its stop
    token) takes the grammar's mask over `unbanned` instead: the grammar wins, so a complete
    grammar finishes its request rather than leaving it nothing to sample."""
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
    if unbanned is not None and unbanned is not logits:
        dead = [r for r in rows if bool(torch.isneginf(out[r]).all())]
        if dead:
            alt = unbanned.clone()
            xgr.apply_token_bitmask_inplace(alt, bitmask.to(alt.device), vocab_size=vocab,
                                            indices=dead)
            out[dead] = alt[dead]
    return out
