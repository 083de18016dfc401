"""Cascade (shared-prefix) attention, for decodes and prefill chunks: read a shared prefix once.

With prefix caching, requests that start with the same prompt have block tables that begin with
the same physical block ids. Attending each request's query to that prefix separately reads the
prefix's K/V once per request; cascade attention (vLLM's cascade attention, FlashInfer's
`merge_state`) instead stacks the queries of all the requests that share it, per KV head, into
one attention call over the prefix (read once), attends each request to its own remaining
blocks separately, and merges the two partial results exactly with their log-sum-exp:

    out = (o_a * exp(lse_a - m) + o_b * exp(lse_b - m)) / (exp(lse_a - m) + exp(lse_b - m))

where m = max(lse_a, lse_b). Groups are found per step from the block tables alone
(`find_shared_prefixes`); attention.py applies them to layers without a sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A shared prefix shorter than this many tokens is attended per request: the saving (one read of
# a few blocks) would not pay for the extra calls and the merge.
MIN_SHARED_TOKENS = 64


@dataclass(frozen=True, eq=False)
class SharedPrefix:
    """Rows `rows` (indices into the step's decodes, or into its prefill chunks; ascending;
    `row_index` the same as a long tensor on the block tables' device) whose block tables all
    start with the `num_blocks` physical blocks `block_ids` [num_blocks], every position of
    which each of those requests sees (all lie before its newest token)."""

    rows: list[int]
    num_blocks: int
    block_ids: torch.Tensor
    row_index: torch.Tensor

    def index(self) -> slice | torch.Tensor:
        """What selects the group's rows of a tensor: a slice when they are consecutive (the
        usual case: every decode of the step shares the prefix), so that reading and writing
        them are views and copies into views, not gathers and scatters; else `row_index`."""
        first, last = self.rows[0], self.rows[-1]
        return slice(first, last + 1) if last - first + 1 == len(self.rows) else self.row_index


def window_hides_nothing(window: int | None, seq_lens: list[int]) -> bool:
    """Whether a sliding `window` (None: none) shows every decode of lengths `seq_lens` its
    whole context: only then may a decode's shared prefix be attended apart (cascade)."""
    return window is None or window >= max(seq_lens)


def find_shared_prefixes(block_tables: torch.Tensor, seq_lens: list[int], block_size: int,
                         min_tokens: int | None = None) -> list[SharedPrefix]:
    """Groups of at least two decodes sharing at least `min_tokens` (default
    `MIN_SHARED_TOKENS`) leading tokens of identical physical blocks.

    `block_tables` [S, W] (rows padded with anything past each request's blocks), `seq_lens` [S]
    (new token included). Requests are grouped by their first block id; a group's prefix is the
    longest run of leading columns identical across its rows, cut so that every block of it lies
    wholly before each member's newest token (that token's block is the request's own).
    """
    min_tokens = MIN_SHARED_TOKENS if min_tokens is None else min_tokens
    s = len(seq_lens)
    if s < 2 or block_tables.shape[1] == 0:
        return []
    by_first: dict[int, list[int]] = {}
    for row, first in enumerate(block_tables[:, 0].tolist()):
        by_first.setdefault(first, []).append(row)
    min_blocks = max(1, -(-min_tokens // block_size))
    groups = []
    for rows in by_first.values():
        cap = min((seq_lens[r] - 1) // block_size for r in rows)
        if len(rows) < 2 or cap < min_blocks:
            continue
        sub = block_tables[rows, :cap] if len(rows) < s else block_tables[:, :cap]
        same = (sub == sub[:1]).all(0)
        n = cap if bool(same.all()) else int(same.int().argmin())
        if n >= min_blocks:
            index = torch.tensor(rows, device=block_tables.device)
            groups.append(SharedPrefix(rows, n, sub[0, :n].clone(), index))
    return groups


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, M, D] in q's dtype, lse [B, H, M] float32) of attention of q [B, H, M, D] over
    k, v [B, H, L, D] (same head count: fold GQA groups into M) with an optional additive mask
    `bias` in q's dtype broadcastable to [B, H, M, L] (0 = visible, -inf = hidden; every row
    must see at least one key).

    On CPU this is the flash kernel that SDPA itself runs (float32 accumulation); elsewhere
    `attention_with_lse_reference`.
    """
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        out, lse = _CPU_FLASH(q, k, v, attn_mask=bias, scale=scale)
        return out, lse
    return attention_with_lse_reference(q, k, v, bias, scale)


def attention_with_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 bias: torch.Tensor | None, scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` as float32 matmuls and a softmax (any device)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if bias is not None:
        scores += bias
    lse = torch.logsumexp(scores, -1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def shared_prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            prefix: SharedPrefix, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [n, heads, D], lse [n, heads] float32) of the decode queries q [n, heads, D] of
    `prefix.rows` over the prefix's blocks only, all n requests in one call per KV head (the
    prefix K/V are read once). Caches are [kv_heads, num_blocks, block_size, D]."""
    n, heads, d = q.shape
    kvh = k_cache.shape[0]
    g = heads // kvh
    kp = k_cache.index_select(1, prefix.block_ids).view(1, kvh, -1, d)
    vp = v_cache.index_select(1, prefix.block_ids).view(1, kvh, -1, d)
    qs = q.view(n, kvh, g, d).transpose(0, 1).reshape(1, kvh, n * g, d)
    out, lse = attention_with_lse(qs, kp, vp, None, scale)
    out = out.view(kvh, n, g, d).transpose(0, 1).reshape(n, heads, d)
    return out, lse.view(kvh, n, g).transpose(0, 1).reshape(n, heads)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> torch.Tensor:
    """Exact attention output over the union of two disjoint key sets from the partial outputs
    o_a, o_b [..., D] and their log-sum-exps lse_a, lse_b [...] (float32); FlashInfer's
    merge_state. Computed in float32, returned in o_a's dtype."""
    m = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - m).unsqueeze(-1)
    w_b = torch.exp(lse_b - m).unsqueeze(-1)
    out = (o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)
    return out.to(o_a.dtype)
