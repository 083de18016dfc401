"""Attention over an int8 or fp8 KV cache read in place by the fused C++ kernel (CPU).

With the CPU kernels loaded (cpu_native's `native`), QuantizedKVBackend builds this metadata: the
step's new K/V are quantized into their slots (int8 by the kernel `write_kv_int8_`, in one pass;
fp8 by kv_quant.quantize_into), then every query token is one row of
`paged_decode_attention_q`, attending to positions first .. its own over its sequence's blocks
in the cache: a decode is one row, a prefill chunk of n tokens n rows (token i of a chunk
starting at position p sees p + i + 1 keys: the causal mask is the row's length). The kernel
takes rows that read the same blocks (a chunk's tokens; decodes sharing a cached prefix) in
tiles of up to 16 that widen each shared block once for all of them; a block only one row reads
is widened in registers as it is read (int8 keys meet q in integers;
per-token int8 scales applied to the scores and the softmax weights; fp8 scales are already
folded in by kv_quant.KVScales): no dequantized copy of the context, half the bytes of a 16-bit
cache streamed, and a token of this step reads back exactly what later steps will read. No
cascade split of shared prefixes (the tiles share their blocks' loads instead). A step with a token that is not
stored (slot < 0) reads only its decodes in place and sends its prefill chunks through
QuantizedKVMetadata (a compact dequantized copy of their blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.model.backends.step import StepSequences
from pagedkv.model.kv_quant import quantize_into


@dataclass
class InPlaceMetadata:
    """The first `num_rows` tokens of the step read in place: their real slots [R], block tables
    [R, W] (their sequence's, one row per token) and lengths [R] (keys up to and including the
    token); the remaining tokens through `prefill` (QuantizedKVMetadata of the prefill-only rest
    of the step; None when every token is a row)."""

    num_rows: int
    slots: torch.Tensor
    block_tables: torch.Tensor
    row_lens: torch.Tensor
    prefill: object | None
    _first: dict = field(default_factory=dict)

    def first_positions(self, window: int | None) -> torch.Tensor:
        """The first key position each row attends to (0, or its sliding window's)."""
        if window not in self._first:
            self._first[window] = (torch.zeros_like(self.row_lens) if window is None
                                   else (self.row_lens - window).clamp_min_(0))
        return self._first[window]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None,
               k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Store the step's k, v [T, kv_heads, D] in the cache's format (caches and, for int8,
        k_scales / v_scales mutated) and attend q [T, heads, D]: the rows in place, the rest
        over their dequantized blocks."""
        r = self.num_rows
        ops = torch.ops.pagedkv_cpu
        if k_scales is not None:
            ops.write_kv_int8_(k[:r], k_cache, k_scales, self.slots)
            ops.write_kv_int8_(v[:r], v_cache, v_scales, self.slots)
        else:
            quantize_into(k_cache, self.slots, k[:r])
            quantize_into(v_cache, self.slots, v[:r])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        ops.paged_decode_attention_q(q[:r], k_cache, v_cache, k_scales, v_scales,
                                     self.block_tables, self.first_positions(window),
                                     self.row_lens, scale, out[:r], None)
        if self.prefill is not None:
            out[r:] = self.prefill.attend(q[r:], k[r:], v[r:], k_cache, v_cache, scale,
                                          window, k_scales=k_scales, v_scales=v_scales)
        return out


def in_place_rows(step: StepSequences, num_seqs: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots [R], block tables [R, W], row lengths [R]) of every token of the step's first
    `num_seqs` sequences, one row per token (R = their new tokens)."""
    counts = torch.tensor(step.num_new_tokens[:num_seqs], dtype=torch.long)
    ends = torch.tensor(step.seq_lens[:num_seqs], dtype=torch.long)
    tables = step.block_tables[:num_seqs]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    rows = int(counts.sum())
    starts = torch.cumsum(counts, 0) - counts  # each sequence's first row
    index = torch.arange(rows) - starts.repeat_interleave(counts)  # the token within its chunk
    row_lens = (ends - counts).repeat_interleave(counts) + index + 1
    slots = torch.tensor(step.slot_mapping[:rows], dtype=torch.long)
    return (slots.to(device), table.repeat_interleave(counts, dim=0).to(device),
            row_lens.to(device))
