"""Attention over an int8 or fp8 KV cache read in place by the fused C++ kernel (CPU).

With the CPU kernels loaded (cpu_native's `fused`), QuantizedKVBackend builds this metadata: the
step's new K/V are quantized into their slots in one pass (int8 by the kernel `write_kv_int8_`,
fp8 by `write_kv_fp8_`: bit-identical to kv_int8.py's and kv_quant.quantize_into's writes),
then the decodes are rows of `paged_decode_attention_q`, attending to positions first .. their
own over their sequence's blocks in the cache, and the prefill chunks go through the tiled prefill kernel (`paged_prefill_attention`, as the
model-dtype cache's chunks do in cpu_native.py: tiles of a chunk's tokens x a KV head's query
heads, causal and windowed by position, each key step's rows widened once per tile). Where the
build has no tiled kernel for q's dtype and head size (`paged_prefill_supports`: an AVX2 build,
float16, ...) a chunk of n tokens is n rows of the decode kernel instead (token i of a chunk
starting at position p sees p + i + 1 keys: the causal mask is the row's length), which takes
rows that read the same blocks (a chunk's tokens; decodes sharing a cached prefix) in tiles of
up to 16 that widen each shared block once for all of them; a block only one row reads is
widened in registers as it is read (int8 keys meet q in integers). Both kernels apply the
per-token int8 scales to the scores and the softmax weights; fp8 scales are already folded in
by kv_quant.KVScales: no dequantized copy of the context, half the bytes of a 16-bit cache
streamed, and a token of this step reads back exactly what later steps will read. Decodes
over a shared cached prefix take cascade attention as the model-dtype cache's do (cascade.py,
cpu_native.py; where the build has the tiled kernel): the decode kernel attends each to its
blocks after the prefix and returns their log-sum-exp, the tiled kernel (not causal) attends all
the group's queries to the prefix's quantized blocks at once, and the two are merged (without
the tiled kernel, the decode kernel's tiles share the prefix blocks' loads instead). A step
with a token that is not stored (slot < 0) reads only its decodes in place and sends its
prefill chunks through QuantizedKVMetadata (a compact dequantized copy of their blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.model.backends.cpu_native import (
    PrefixRuns,
    prefix_attention,
    prefix_runs,
    tiled_prefill,
)
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.cascade import (
    SharedPrefix,
    find_shared_prefixes,
    merge_states,
    window_hides_nothing,
)


@dataclass
class InPlaceMetadata:
    """The first `num_rows` tokens of the step (those of its first `num_seqs` sequences) read in
    place: their real slots [R]; the first `num_decodes` sequences are decodes, the rest prefill
    chunks, given also as `chunks` (first row [C], end row [C], sequence length [C], block
    tables [C, W]; None when there are none) for the tiled kernel; `tables` [S, W] and
    `seq_lens` [S] of the sequences; the remaining tokens through `prefill`
    (QuantizedKVMetadata of the prefill-only rest of the step; None when every token is a
    row). A chunk's per-token rows for the decode kernel are built only when a call needs them
    (`rows`: a build without the tiled kernel for q)."""

    num_rows: int
    slots: torch.Tensor
    step: StepSequences
    num_seqs: int
    tables: torch.Tensor
    seq_lens: torch.Tensor
    prefill: object | None
    num_decodes: int = 0
    chunks: tuple[torch.Tensor, ...] | None = None
    block_size: int = 0
    _cache: dict = field(default_factory=dict)

    @classmethod
    def for_step(cls, step: StepSequences, num_seqs: int, prefill: object | None,
                 device: torch.device) -> InPlaceMetadata:
        """The metadata of the step's first `num_seqs` sequences read in place (`prefill`: the
        rest's)."""
        counts = step.num_new_tokens[:num_seqs]
        rows = sum(counts)
        slots = torch.tensor(step.slot_mapping[:rows], dtype=torch.long, device=device)
        tables = padded_tables(step.block_tables[:num_seqs], device)
        lens = torch.tensor(step.seq_lens[:num_seqs], dtype=torch.long, device=device)
        nd = min(step.num_decodes, num_seqs)
        chunks = None
        if num_seqs > nd:
            ends = torch.tensor(counts, dtype=torch.long).cumsum(0)[nd:]
            starts = ends - torch.tensor(counts[nd:], dtype=torch.long)
            chunks = (starts.to(device), ends.to(device), lens[nd:], tables[nd:])
        return cls(num_rows=rows, slots=slots, step=step, num_seqs=num_seqs, tables=tables,
                   seq_lens=lens, prefill=prefill, num_decodes=nd, chunks=chunks,
                   block_size=step.block_size)

    def shared_prefixes(self, window: int | None) -> list[SharedPrefix]:
        """Groups of decodes whose block tables start with the same cached blocks
        (cascade.find_shared_prefixes), none when the window hides part of some decode's
        context; once per step per window."""
        key = ("shared", window)
        if key not in self._cache:
            lens = self.seq_lens[:self.num_decodes].tolist()
            groups = []
            if len(lens) >= 2 and window_hides_nothing(window, lens):
                groups = find_shared_prefixes(self.tables[:len(lens)], lens, self.block_size)
            self._cache[key] = groups
        return self._cache[key]

    def rows(self, tokens: bool, window: int | None,
             shared: list[SharedPrefix] = ()) -> tuple[torch.Tensor, ...]:
        """(block tables [N, W], first key position [N], length [N]) of the decode kernel's
        rows: the decodes, or (`tokens`) every token read in place; a row's first position is
        0 or its sliding window's, a decode of a `shared` group's the first after the group's
        prefix; once per step, window and `shared`."""
        key = ("rows", tokens, window, bool(shared))
        if key not in self._cache:
            nd = self.num_decodes
            if tokens and self.num_rows > nd:
                tables, lens = in_place_rows(self.step, self.num_seqs, self.slots.device)[1:]
            else:
                tables, lens = self.tables[:nd], self.seq_lens[:nd]
            first = (torch.zeros_like(lens) if window is None
                     else (lens - window).clamp_min_(0))
            for group in shared:
                first[group.row_index] = group.num_blocks * self.block_size
            self._cache[key] = (tables, first, lens)
        return self._cache[key]

    def prefix_runs(self, group: SharedPrefix) -> PrefixRuns:
        """cpu_native.prefix_runs of `group`, once per step."""
        key = ("prefix_runs", tuple(group.rows))
        if key not in self._cache:
            self._cache[key] = prefix_runs(group, self.block_size)
        return self._cache[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None,
               k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Store the step's k, v [T, kv_heads, D] in the cache's format (caches and, for int8,
        k_scales / v_scales mutated) and attend q [T, heads, D]: the rows in place (prefill
        chunks through the tiled kernel where the build has it), the rest over their
        dequantized blocks."""
        r, t = self.num_rows, q.shape[0]
        ops = torch.ops.pagedkv_cpu
        kr, vr = (k, v) if r == t else (k[:r], v[:r])
        if k_scales is not None:
            ops.write_kv_int8_(kr, k_cache, k_scales, self.slots)
            ops.write_kv_int8_(vr, v_cache, v_scales, self.slots)
        else:
            ops.write_kv_fp8_(kr, k_cache, self.slots)
            ops.write_kv_fp8_(vr, v_cache, self.slots)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        has_tiled = tiled_prefill(q.shape[2], q.dtype)
        tiled = self.chunks is not None and has_tiled
        shared = self.shared_prefixes(window) if has_tiled else []
        tables, first, lens = self.rows(not tiled, window, shared)
        n = lens.shape[0]
        lse = torch.empty(n, q.shape[1], dtype=torch.float32) if shared else None
        if n:
            ops.paged_decode_attention_q(q if n == t else q[:n], k_cache, v_cache, k_scales,
                                         v_scales, tables, first, lens, scale,
                                         out if n == t else out[:n], lse)
        for group in shared:
            self._merge_prefix(q, k_cache, v_cache, k_scales, v_scales, group, scale, out, lse)
        if tiled:
            starts, ends, lens, tables = self.chunks
            ops.paged_prefill_attention(q if r == t else q[:r], k_cache, v_cache, tables, starts,
                                        ends, lens, window or 0, scale,
                                        out if r == t else out[:r], True, None, k_scales,
                                        v_scales)
        if self.prefill is not None:
            out[r:] = self.prefill.attend(q[r:], k[r:], v[r:], k_cache, v_cache, scale,
                                          window, k_scales=k_scales, v_scales=v_scales)
        return out

    def _merge_prefix(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k_scales: torch.Tensor | None, v_scales: torch.Tensor | None,
                      group: SharedPrefix, scale: float, out: torch.Tensor,
                      lse: torch.Tensor) -> None:
        """Cascade's second half for the decodes of `group`: their queries over the shared
        prefix's quantized blocks in one tiled-kernel call, merged (by log-sum-exp) into
        their rows of `out`, which hold their attention over the rest with `lse` (mutated)."""
        nd = self.num_decodes
        o_p, lse_p = prefix_attention(q[:nd], k_cache, v_cache, self.prefix_runs(group), scale,
                                      k_scales, v_scales)
        rows = group.index()
        out[rows] = merge_states(out[rows], lse[rows], o_p[rows], lse_p[rows])



def padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """`tables` as one [S, W] tensor (W: the longest; shorter rows padded with block 0)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                        device=device)


def in_place_rows(step: StepSequences, num_seqs: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots [R], block tables [R, W], row lengths [R]) of every token of the step's first
    `num_seqs` sequences, one row per token (R = their new tokens)."""
    counts = torch.tensor(step.num_new_tokens[:num_seqs], dtype=torch.long)
    ends = torch.tensor(step.seq_lens[:num_seqs], dtype=torch.long)
    table = padded_tables(step.block_tables[:num_seqs], torch.device("cpu"))
    rows = int(counts.sum())
    slots = torch.tensor(step.slot_mapping[:rows], dtype=torch.long)
    if rows == num_seqs:  # decodes only: a row per sequence, as it is
        return slots.to(device), table.to(device), ends.to(device)
    starts = torch.cumsum(counts, 0) - counts  # each sequence's first row
    index = torch.arange(rows) - starts.repeat_interleave(counts)  # the token within its chunk
    row_lens = (ends - counts).repeat_interleave(counts) + index + 1
    return (slots.to(device), table.repeat_interleave(counts, dim=0).to(device),
            row_lens.to(device))
