"""BlockTableRows: a step's block tables as one persistent host tensor, rewritten only where a
row changed since the last step (vLLM's persistent-batch `BlockTable`).

Building every row's padded list and a new tensor from them each step costs O(batch x blocks)
Python work per step. In a decode step almost every row is the table it was the step before
(same request, same blocks; one in `block_size` steps gains a block), so each row is checked
against the copy last written to it (a list compare, in C) and only changed rows are written,
together, in one indexed copy.
"""

from __future__ import annotations

import torch


class BlockTableRows:
    """The persistent [rows, width] tensor; row i holds `self._rows[i]` padded with the null
    block 0 (the invariant every method keeps). `build` returns a copy: a step may build
    several tables with one backend (KV cache groups) and each must stay as built."""

    def __init__(self, dtype: torch.dtype = torch.long) -> None:
        self.dtype = dtype
        self._rows: list[list[int]] = []  # what each row holds (copies: callers mutate theirs)
        self._tensor = torch.zeros(0, 0, dtype=dtype)
        self.rows_written = 0  # rows rewritten so far (tests and benchmarks read it)

    def build(self, tables: list[list[int]]) -> torch.Tensor:
        """`tables` as a new contiguous [len(tables), longest] host tensor padded with 0 (the
        kernels read rows of that width): one copy of the persistent tensor's rows (mutated:
        those whose table changed are rewritten)."""
        n = len(tables)
        width = max(map(len, tables), default=0)
        self._reserve(n, width)
        rows = self._rows
        changed = [i for i in range(n) if tables[i] != rows[i]]
        if changed:
            self._write(changed, tables)
        return self._tensor[:n, :width].clone(memory_format=torch.contiguous_format)

    def _reserve(self, n: int, width: int) -> None:
        """Grow the tensor (doubling) to at least n rows of `width` (new cells 0)."""
        old = self._tensor
        num_rows, old_width = old.shape
        if n <= num_rows and width <= old_width:
            return
        grown = torch.zeros(max(n, 2 * num_rows), max(width, 2 * old_width), dtype=self.dtype)
        grown[:num_rows, :old_width] = old
        self._tensor = grown
        self._rows += [[] for _ in range(grown.shape[0] - num_rows)]

    def _write(self, changed: list[int], tables: list[list[int]]) -> None:
        """Rewrite rows `changed` with their `tables` (whole rows: the tail zeroed)."""
        full = self._tensor.shape[1]
        rows = self._rows
        padded = []
        for i in changed:
            table = list(tables[i])
            rows[i] = table
            padded.append(table + [0] * (full - len(table)))
        index = torch.tensor(changed, dtype=torch.long)
        self._tensor.index_copy_(0, index, torch.tensor(padded, dtype=self.dtype))
        self.rows_written += len(changed)
