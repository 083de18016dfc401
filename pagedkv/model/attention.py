"""Paged attention in pure torch (CPU and CUDA).

KV cache layout (one pair per layer, made in kv_cache.py): `k_cache`, `v_cache` are
[num_blocks, block_size, num_kv_heads, head_dim]; the token at position p of a request lives in
slot `block_table[p // block_size] * block_size + p % block_size`, i.e. row `slot` of the
[num_blocks * block_size, num_kv_heads, head_dim] view.

One `paged_attention` call per layer serves a mixed batch laid out as the runner builds it:
the decode tokens first (one per request, batched together), then the prefill chunks (each a
run of consecutive tokens of one request that attend causally to the request's cached prefix
and to themselves). A sliding window W lets the token at position p see positions p-W+1 .. p
(transformers' Mistral convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F


@dataclass
class PrefillChunk:
    """Tokens [token_start, token_end) of the flattened batch: positions start_pos .. seq_len - 1
    of one request whose K/V for positions 0 .. seq_len - 1 sit in `block_table` [num_blocks]."""

    token_start: int
    token_end: int
    start_pos: int
    seq_len: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer (built by the runner).

    `slot_mapping` [T]: cache slot of each token of the batch. The first `num_decodes` tokens
    are decodes of requests whose lengths (new token included) are `decode_seq_lens`
    [num_decodes] and whose block tables are the rows of `decode_block_tables`
    [num_decodes, max_blocks] (padded with the null block 0).
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    prefills: list[PrefillChunk]
    block_size: int
    _mask_cache: dict = field(default_factory=dict, repr=False)

    def decode_mask(self, window: int | None, num_keys: int) -> torch.Tensor:
        """[num_decodes, 1, 1, num_keys] bool: which gathered keys each decode token sees."""
        key = ("decode", window, num_keys)
        if key not in self._mask_cache:
            j = torch.arange(num_keys, device=self.decode_seq_lens.device)
            lens = self.decode_seq_lens[:, None]
            mask = j[None, :] < lens
            if window is not None:
                mask &= j[None, :] > lens - 1 - window
            self._mask_cache[key] = mask[:, None, None, :]
        return self._mask_cache[key]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] into their slots of k_cache / v_cache (mutated)."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[S, kv_heads, max_blocks * block_size, head_dim] view of the blocks in `block_tables`
    [S, max_blocks] (a fresh gathered copy; valid as long as the caller keeps it)."""
    s, mb = block_tables.shape
    _, bs, h, d = cache.shape
    return cache[block_tables].view(s, mb * bs, h, d).transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, causal: bool = False) -> torch.Tensor:
    if q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  scale=scale, enable_gqa=True)
        except (RuntimeError, TypeError):
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Attention output [T, heads, head_dim] for q [T, heads, head_dim].

    k, v [T, kv_heads, head_dim] are the batch's new keys/values: they are written into the
    cache first (mutating k_cache / v_cache), then every token attends through its block table.
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta, scale, window)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_end
        out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale,
                                     window)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """One query token per request, all requests at once: q [S, heads, head_dim]."""
    kg = gather_kv(k_cache, meta.decode_block_tables)
    vg = gather_kv(v_cache, meta.decode_block_tables)
    mask = meta.decode_mask(window, kg.shape[2])
    return _sdpa(q.unsqueeze(2), kg, vg, mask, scale).squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                      window: int | None) -> torch.Tensor:
    """Causal attention of one prefill chunk, q [n, heads, head_dim], over prefix + itself."""
    n = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)
    if chunk.start_pos == 0 and (window is None or window >= n):
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        return _sdpa(qh, kh, vh, None, scale, causal=True)[0].transpose(0, 1)
    bs = k_cache.shape[1]
    num_blocks = (chunk.seq_len + bs - 1) // bs
    table = chunk.block_table[:num_blocks].unsqueeze(0)
    kg, vg = gather_kv(k_cache, table), gather_kv(v_cache, table)
    pos = torch.arange(chunk.start_pos, chunk.seq_len, device=q.device)[:, None]
    j = torch.arange(kg.shape[2], device=q.device)[None, :]
    mask = j <= pos
    if window is not None:
        mask &= j > pos - window
    return _sdpa(qh, kg, vg, mask, scale)[0].transpose(0, 1)
