"""Paged attention with tanh soft-capping of the scores (Gemma 2's `attn_logit_softcapping`).

scores = cap * tanh(q.k * scale / cap), then softmax, as transformers' eager Gemma 2 computes.
The attention backends do not cap, so Gemma 2 layers with a cap run this plain torch path over
the metadata of any backend (they all carry `slot_mapping`, the decode tables and lengths and
the prefill chunks): write the step's K/V into the cache, then per sequence gather the keys
it sees (its window's) and attend. Correct first; one sequence at a time.
"""

from __future__ import annotations

import torch

from pagedkv.model.attention import AttentionMetadata, write_kv


def _gather(cache: torch.Tensor, table: torch.Tensor, first: int, last: int,
            block_size: int) -> torch.Tensor:
    """Positions first .. last - 1 of a sequence: [kv_heads, last - first, head_dim]."""
    pos = torch.arange(first, last, device=cache.device)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    return cache.flatten(1, 2).index_select(1, slots)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_pos: torch.Tensor, scale: float, cap: float, window: int | None) -> torch.Tensor:
    """q [n, heads, D] at positions q_pos; k, v [kv_heads, L, D] at k_pos -> [n, heads, D]."""
    group = q.shape[1] // k.shape[0]
    k = k.repeat_interleave(group, dim=0).float()
    v = v.repeat_interleave(group, dim=0).float()
    scores = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    scores = torch.tanh(scores / cap) * cap
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,hld->nhd", scores.softmax(-1), v).to(q.dtype)


def softcap_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, softcap: float,
                            window: int | None) -> torch.Tensor:
    """Attention of the step's queries q [T, heads, D] (new keys k, v [T, kv_heads, D]) over the
    paged cache, scores soft-capped at `softcap`; writes k, v into the cache first."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    bs = meta.block_size
    lens = meta.decode_seq_lens_list or meta.decode_seq_lens.tolist()
    for i, n in enumerate(lens[:meta.num_decodes]):
        first = 0 if window is None else max(0, n - window)
        table = meta.decode_block_tables[i]
        out[i:i + 1] = _attend(q[i:i + 1], _gather(k_cache, table, first, n, bs),
                               _gather(v_cache, table, first, n, bs),
                               torch.tensor([n - 1], device=q.device),
                               torch.arange(first, n, device=q.device), scale, softcap, window)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_end
        first = 0 if window is None else max(0, chunk.start_pos - window + 1)
        out[s:e] = _attend(q[s:e], _gather(k_cache, chunk.block_table, first, chunk.seq_len, bs),
                           _gather(v_cache, chunk.block_table, first, chunk.seq_len, bs),
                           torch.arange(chunk.start_pos, chunk.seq_len, device=q.device),
                           torch.arange(first, chunk.seq_len, device=q.device), scale, softcap,
                           window)
    return out
