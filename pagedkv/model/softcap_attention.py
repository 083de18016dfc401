"""Paged attention with tanh soft-capping of the scores (Gemma 2's `attn_logit_softcapping`).

scores = cap * tanh(q.k * scale / cap), then softmax, as transformers' eager Gemma 2 computes.
The CUDA backend's Triton kernel caps inside its online softmax (its metadata `caps_scores`);
the CPU backends do not, so there Gemma 2 layers with a cap run this plain torch path over the
backend's metadata (`slot_mapping`, the decode tables and lengths and the prefill chunks; the
runner does not wrap the backend for a quantized cache, see
`Gemma2ForCausalLM.attention_reads_kv_cache`): write the step's K/V into the cache, then per
sequence gather the keys it sees (its window's) and attend. Correct first; one sequence at a
time.

Any cache format: `SoftcappedMetadata` is a metadata whose `attend` is this, so a layer's
quantized-cache scales wrap it as they wrap a backend's (fp8: `KVScales.attend` divides the
scales out of the stored K/V and folds them into the queries, the softmax scale and the output,
exact before the cap as after it; int8: `PerTokenScales.attend` passes its scale caches). The
K/V go in through the write every quantized path uses (`backends.quantized.store_kv`) and come
back from the cache dequantized to float32 (the step's own tokens too: a token reads the same
in the step that computes it as in every later one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.model.backends.quantized import store_kv
from pagedkv.model.kv_int8 import dequantize_per_token
from pagedkv.model.kv_quant import dequantize, storage_view


def _slots(table: torch.Tensor, first: int, last: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions first .. last - 1 of a sequence with block table `table`."""
    pos = torch.arange(first, last, device=table.device)
    return table[pos // block_size].long() * block_size + pos % block_size


def _gather(cache: torch.Tensor, scales: torch.Tensor | None,
            slots: torch.Tensor) -> torch.Tensor:
    """The values in `slots` of `cache` [kv_heads, blocks, block_size, D] (any format; int8
    with its per-token `scales` [kv_heads, blocks, block_size]) as float32
    [kv_heads, len(slots), D] (a new tensor)."""
    raw = storage_view(cache).flatten(1, 2).index_select(1, slots).view(cache.dtype)
    if scales is None:
        return dequantize(raw, torch.float32)
    return dequantize_per_token(raw, scales.flatten(1, 2).index_select(1, slots), torch.float32)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_pos: torch.Tensor, scale: float, cap: float, window: int | None) -> torch.Tensor:
    """q [n, heads, D] at positions q_pos; k, v [kv_heads, L, D] float32 at k_pos ->
    [n, heads, D] in q's dtype."""
    group = q.shape[1] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    scores = torch.tanh(scores / cap) * cap
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,hld->nhd", scores.softmax(-1), v).to(q.dtype)


def softcap_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: Any, scale: float, softcap: float,
                            window: int | None, k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's queries q [T, heads, D] (new keys k, v [T, kv_heads, D]) over the
    paged cache of any format, scores soft-capped at `softcap`; stores k, v into the cache
    first (mutating k_cache / v_cache, and for int8 their scale caches k_scales / v_scales)."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales)
    out = torch.empty_like(q)
    bs = meta.block_size

    def attend(rows: slice, table: torch.Tensor, first: int, last: int) -> None:
        slots = _slots(table, first, last, bs)
        out[rows] = _attend(q[rows], _gather(k_cache, k_scales, slots),
                            _gather(v_cache, v_scales, slots),
                            torch.arange(last - (rows.stop - rows.start), last, device=q.device),
                            torch.arange(first, last, device=q.device), scale, softcap, window)

    lens = meta.decode_seq_lens_list or meta.decode_seq_lens.tolist()
    for i, n in enumerate(lens[:meta.num_decodes]):
        attend(slice(i, i + 1), meta.decode_block_tables[i],
               0 if window is None else max(0, n - window), n)
    for chunk in meta.prefills:
        first = 0 if window is None else max(0, chunk.start_pos - window + 1)
        attend(slice(chunk.token_start, chunk.token_end), chunk.block_table, first,
               chunk.seq_len)
    return out


@dataclass(frozen=True)
class SoftcappedMetadata:
    """A backend's step metadata `inner` whose `attend` soft-caps the scores at `softcap`
    (the seam a layer calls, with or without its quantized-cache scales in between)."""

    inner: Any
    softcap: float

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None,
               k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """`inner`'s own soft-capped attention where it has one (`caps_scores`: the Triton
        kernel), else `softcap_paged_attention` over `inner` (mutates the caches as it says)."""
        if getattr(self.inner, "caps_scores", False):
            return self.inner.attend(q, k, v, k_cache, v_cache, scale, window, k_scales,
                                     v_scales, softcap=self.softcap)
        return softcap_paged_attention(q, k, v, k_cache, v_cache, self.inner, scale,
                                       self.softcap, window, k_scales, v_scales)
