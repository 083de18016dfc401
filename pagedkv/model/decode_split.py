"""Split-KV decode attention for one sequence (the classic paged-attention v2 choice): its
context cut into `parts` runs of whole blocks, each run a row of the fused decode kernel
(`paged_decode_attention_q`, reading the paged cache in place in any KV format) that also
returns its log-sum-exp, and the runs merged exactly by their log-sum-exps.

The decode kernel shares its work out by (sequence, KV head): one sequence of a model with
fewer KV heads than threads (or a count that does not divide among them: 3 KV heads on 2
threads) leaves threads idle however long its context; its runs give the kernel `parts` times
the items. On one thread it only adds the merge (decode_choice.py measures that cost and
takes the split where the threads' balance pays for it).
"""

from __future__ import annotations

import torch

SplitRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # tables [P, W], first [P], lens [P]


def split_rows(table: torch.Tensor, first: int, length: int, block_size: int,
               parts: int) -> SplitRows:
    """(block tables [parts, W], first positions [parts], lengths [parts]) of the `parts`
    runs of one sequence's keys first .. length - 1 (block table `table` [W]): run p's table
    starts at its first block, its positions counted from there (the kernel sees each run as a
    sequence of its own, so a run's rows start with distinct blocks and are not tiled
    together). The runs cover the blocks evenly; every run holds at least one key when
    length - first >= parts * block_size."""
    first_block, end_block = first // block_size, -(-length // block_size)
    per = -(-(end_block - first_block) // parts)
    width = table.shape[0]
    tables = torch.zeros(parts, width, dtype=torch.long)
    firsts, lens = [], []
    for p in range(parts):
        b0 = min(first_block + p * per, end_block)
        b1 = min(b0 + per, end_block)
        tables[p, : width - b0] = table[b0:]
        start = b0 * block_size
        firsts.append(max(first - start, 0))
        lens.append(max(min(length, b1 * block_size) - start, 0))
    return tables, torch.tensor(firsts, dtype=torch.long), torch.tensor(lens, dtype=torch.long)


def split_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rows: SplitRows, scale: float, out: torch.Tensor,
                 k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The attention of one decode q [1, heads, D] over its runs `rows` (`split_rows`), written
    into `out` [1, heads, D] (returned): each run one row of the decode kernel (the query
    repeated without a copy), merged by log-sum-exp in float32. Caches as the kernel takes
    them (q's dtype, or int8 with `k_scales` / `v_scales`, or fp8)."""
    tables, firsts, lens = rows
    parts = tables.shape[0]
    heads, d = q.shape[1], q.shape[2]
    part_out = torch.empty(parts, heads, d, dtype=q.dtype)
    lse = torch.empty(parts, heads, dtype=torch.float32)
    torch.ops.pagedkv_cpu.paged_decode_attention_q(
        q.expand(parts, heads, d), k_cache, v_cache, k_scales, v_scales, tables, firsts, lens,
        scale, part_out, lse)
    weights = torch.softmax(lse, 0).unsqueeze(-1)  # [parts, heads, 1]: a run's share
    out[0].copy_((part_out * weights).sum(0))  # bfloat16 x float32: summed in float32
    return out
