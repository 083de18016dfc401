"""The vocabulary-parallel embedding: each rank looks up the ids in its own vocabulary rows
(zeros for the others), and one all-reduce sums the ranks' rows into every token's embedding
(exactly: all but one term are zeros). The LM head's logits are gathered to rank 0."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.model.parallel.group import TensorParallelGroup
from pagedkv.model.parallel.sharding import TensorParallelShape


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + num_local) of a [vocab, hidden] embedding; forward returns the full
    embedding of `ids` on every rank."""

    def __init__(self, num_local: int, hidden: int, first: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local, hidden))
        self.first, self.num_local, self.group = first, num_local, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.group.all_reduce(out)


def vocab_embedding(vocab_size: int, hidden: int, tp: TensorParallelGroup | None,
                    shard: TensorParallelShape | None) -> nn.Module:
    """The whole embedding, or (with `shard`) rank `shard.rank`'s vocabulary rows of it."""
    if shard is None:
        return nn.Embedding(vocab_size, hidden)
    return VocabParallelEmbedding(shard.local_vocab, hidden, shard.first_vocab, tp)


def gather_vocab_logits(logits: torch.Tensor, tp: TensorParallelGroup | None,
                        vocab_size: int) -> torch.Tensor | None:
    """The full [N, vocab_size] logits from every rank's vocabulary slice, on rank 0 (None on
    the others; `logits` itself without tensor parallelism)."""
    if tp is None:
        return logits
    parts = tp.gather_to_driver(logits.contiguous())
    return None if parts is None else torch.cat(parts, 1)[:, :vocab_size]
