"""Decodes over an int8 or fp8 KV cache read in place by the fused C++ kernel.

With the CPU kernels loaded (cpu_native's `native`), QuantizedKVBackend builds this metadata for
steps with decodes: a decode's new K/V are quantized into their slots (int8 by the kernel
`write_kv_int8_`, in one pass; fp8 by kv_quant.quantize_into) and
`paged_decode_attention_q` attends it over the cache's own blocks, widening each int8 or fp8
block to float32 as it reads it (per-token int8 scales applied to the scores and the softmax
weights; fp8 scales are already folded in by kv_quant.KVScales): no dequantized copy, half the
bytes of a 16-bit cache streamed. A decode attends to all of its blocks (no cascade split of
shared prefixes: they cost the same bytes). The step's prefill chunks, if any, go through
QuantizedKVMetadata over a compact dequantized copy of their own blocks only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.model.kv_quant import quantize_into


@dataclass
class InPlaceDecodeMetadata:
    """`num_decodes` decodes read in place (their real slots [nd], block tables [nd, W] and
    sequence lengths [nd]), then the prefill rows through `prefill` (QuantizedKVMetadata of the
    prefill-only step; None when the step has no prefill)."""

    num_decodes: int
    decode_slots: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_seq_lens_list: list[int]
    prefill: object | None
    _first: dict = field(default_factory=dict)

    def first_positions(self, window: int | None) -> torch.Tensor:
        """The first key position each decode attends to (0, or its sliding window's)."""
        if window not in self._first:
            lens = self.decode_seq_lens_list
            self._first[window] = torch.tensor(
                [0 if window is None else max(0, n - window) for n in lens], dtype=torch.long)
        return self._first[window]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None,
               k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Store the step's k, v [T, kv_heads, D] in the cache's format (caches and, for int8,
        k_scales / v_scales mutated) and attend q [T, heads, D]: decodes in place, prefills
        over their dequantized blocks."""
        nd = self.num_decodes
        ops = torch.ops.pagedkv_cpu
        if k_scales is not None:
            ops.write_kv_int8_(k[:nd], k_cache, k_scales, self.decode_slots)
            ops.write_kv_int8_(v[:nd], v_cache, v_scales, self.decode_slots)
        else:
            quantize_into(k_cache, self.decode_slots, k[:nd])
            quantize_into(v_cache, self.decode_slots, v[:nd])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        ops.paged_decode_attention_q(q[:nd], k_cache, v_cache, k_scales, v_scales,
                                     self.decode_block_tables, self.first_positions(window),
                                     self.decode_seq_lens, scale, out[:nd], None)
        if self.prefill is not None:
            out[nd:] = self.prefill.attend(q[nd:], k[nd:], v[nd:], k_cache, v_cache, scale,
                                           window, k_scales=k_scales, v_scales=v_scales)
        return out
