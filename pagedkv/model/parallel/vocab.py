"""The vocabulary-parallel embedding: each rank looks up the ids in its own vocabulary rows
(zeros for the others), and one all-reduce sums the ranks' rows into every token's embedding
(exactly: all but one term are zeros)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.model.parallel.group import TensorParallelGroup


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
