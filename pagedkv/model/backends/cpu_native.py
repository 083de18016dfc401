"""The CPU attention backend with the fused C++ kernels (pagedkv/kernels/csrc/).

Decodes read K/V straight from the paged cache, one block at a time with an online softmax
(`paged_decode_attention`: no gathered copy, no mask tensors, the query heads of a KV head
sharing each block's loads), and the new K/V go into their slots in one pass (`write_kv_`).
Shared prefixes keep cascade attention (cascade.py) for decodes: the kernel attends each decode
to its own blocks after the shared ones and returns their log-sum-exp, merged with the prefix
part, which `paged_prefill_attention` computes with all the group's queries in tiles (not
causal: every decode sees the whole prefix) where the build has the tiled kernel. Prefill
chunks, with or without a cached (or shared) prefix, go through `paged_prefill_attention` in
one call per layer: tiles of query tokens x a KV head's query heads read their keys in place,
causal and windowed by position (no gathered copy, no cascade split: each tile reads the prefix
blocks once). Where the build has no tiled kernel for the dtype and head size
(`paged_prefill_supports`: an AVX2 build, a head size other than 64 or 128, float16, bfloat16
without AVX512-BF16) prefill chunks take the pure-torch path of torch_paged.py.

A step's fresh prompts (bfloat16, a CPU with AMX tiles) run `amx_prefill_attention` on the
step's own K/V instead (prefill_choice.py), its other chunks as above.
Decodes' shared prefixes there run `amx_prefix_attention` (prefill_choice.py), merged into the
own blocks' part in the kernel (`amx_prefix_attention_merge_`) when the group's rows are
consecutive; so do prefill chunks that share a cached prefix and follow one another in the batch
(`PrefillCascade`: each token over its own keys by the fused decode kernel, a row per token,
then all of them over the prefix on AMX tiles, merged in place).

Which kernel runs a step's decodes is measured per attention class (decode_choice.py): the
fused kernel (which cuts a lone decode's context into parts where its KV heads do not fill
the threads) or torch's attention over gathered blocks (attention.decode_attention); a step's
prefill chunks likewise (prefill_choice.py).

Until the kernels are loaded (pagedkv.kernels.cpu builds them on first use), or when the
runner turns `fused` off, this backend is exactly torch_paged's.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from itertools import pairwise

import torch

from pagedkv.model.attention import (
    AttentionMetadata,
    PrefillChunk,
    decode_attention,
    prefill_attention_all,
)
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.backends.torch_paged import TorchPagedBackend
from pagedkv.model.cascade import (
    SharedPrefix,
    merge_states,
    shared_prefix_attention,
    window_hides_nothing,
)
from pagedkv.model.decode_choice import DecodeClass, decode_route
from pagedkv.model.prefill_choice import (
    amx_prefill_ok,
    amx_prefix_ok,
    fresh_prompt,
    native_prefill,
)


@cache
def tiled_prefill(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the loaded build's `paged_prefill_attention` takes caches of `dtype` and
    `head_dim` (a fact of the library, the same for every engine of the process)."""
    return bool(torch.ops.pagedkv_cpu.paged_prefill_supports(head_dim, dtype))


class NativeAttentionMetadata(AttentionMetadata):
    """AttentionMetadata whose `attend` runs the fused kernels for the KV write, decodes and
    prefill chunks."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        torch.ops.pagedkv_cpu.write_kv_(k, v, k_cache, v_cache, self.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = self.num_decodes
        if not self.prefills:  # decodes only (no slicing: a measurable cost per layer)
            if nd:
                self._decode(q, k_cache, v_cache, scale, window, out)
            return out
        if nd:
            self._decode(q[:nd], k_cache, v_cache, scale, window, out[:nd])
        rest: NativeAttentionMetadata | None = self
        if amx_prefill_ok(q, k, v, k_cache):
            fresh, rest = self._amx_split(window)
            if fresh is not None:
                torch.ops.pagedkv_cpu.amx_prefill_attention(q, k, v, *fresh, scale, out)
        if rest is not None and self._amx_prefix(q, k_cache):
            cascades, rest = rest._amx_cascade_split(window)
            for cascade in cascades:
                cascade.attend(q, k_cache, v_cache, scale, out)
        if rest is not None:
            rest._prefill_chunks(q, k, v, k_cache, v_cache, scale, window, out)
        return out

    def _amx_cascade_split(self, window: int | None
                           ) -> tuple[list[PrefillCascade], NativeAttentionMetadata | None]:
        """(the prefill chunks that share a cached prefix and lie one after another in the
        batch, each group a `PrefillCascade`; this metadata with the other chunks only, or
        None), once per step per window (a window hiding any of a chunk's keys: none)."""
        key = ("amx_cascades", window)
        if key not in self._mask_cache:
            cascades, grouped = [], set()
            if window is None or window >= max(c.seq_len for c in self.prefills):
                for group in self.prefill_shared_prefixes():
                    chunks = [self.prefills[r] for r in group.rows]
                    if all(a.token_end == b.token_start for a, b in pairwise(chunks)):
                        cascades.append(PrefillCascade.of(chunks, group, self.block_size))
                        grouped.update(group.rows)
            others = [c for r, c in enumerate(self.prefills) if r not in grouped]
            rest = self if not grouped else (
                dataclasses.replace(self, prefills=others, _mask_cache={}) if others else None)
            self._mask_cache[key] = (cascades, rest)
        return self._mask_cache[key]

    def _prefill_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                        window: int | None, out: torch.Tensor) -> None:
        """This metadata's prefill chunks by the fused kernel or torch's attention."""
        if tiled_prefill(q.shape[2], q.dtype) and k_cache.dtype == q.dtype \
                and native_prefill(q, k_cache, self.prefills):  # else torch's: measured faster
            self._prefill(q, k_cache, v_cache, scale, window, out)
        else:
            prefill_attention_all(q, k, v, k_cache, v_cache, self, scale, window, out)

    def _amx_split(self, window: int | None) -> tuple[tuple[torch.Tensor, torch.Tensor] | None,
                                                      NativeAttentionMetadata | None]:
        """((first rows, end rows) of the step's fresh prompts, or None; this metadata with the
        other prefill chunks only, or None), once per step per window."""
        key = ("amx_split", window)
        if key not in self._mask_cache:
            fresh, others = [], []
            for c in self.prefills:
                (fresh if fresh_prompt(c, window) else others).append(c)
            if not fresh:
                self._mask_cache[key] = (None, self)
            else:
                rows = (torch.tensor([c.token_start for c in fresh], dtype=torch.long),
                        torch.tensor([c.token_end for c in fresh], dtype=torch.long))
                rest = dataclasses.replace(self, prefills=others, _mask_cache={}) \
                    if others else None
                self._mask_cache[key] = (rows, rest)
        return self._mask_cache[key]

    def _prefill_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(first row [C], end row [C], sequence length [C]) of each prefill chunk; once per
        step."""
        if "native_prefill" not in self._mask_cache:
            chunks = self.prefills
            self._mask_cache["native_prefill"] = (
                torch.tensor([c.token_start for c in chunks], dtype=torch.long),
                torch.tensor([c.token_end for c in chunks], dtype=torch.long),
                torch.tensor([c.seq_len for c in chunks], dtype=torch.long))
        return self._mask_cache["native_prefill"]

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float, window: int | None, out: torch.Tensor) -> None:
        """Every prefill chunk's attention (their K/V already in the cache) into its rows of
        `out` [T, heads, D], one kernel call."""
        starts, ends, lens = self._prefill_rows()
        torch.ops.pagedkv_cpu.paged_prefill_attention(
            q, k_cache, v_cache, self.prefill_block_tables(), starts, ends, lens, window or 0,
            scale, out)

    def _first_positions(self, window: int | None) -> tuple[torch.Tensor, list]:
        """(first key position each decode attends to here [num_decodes], the shared-prefix
        groups attended separately), once per step per window (a window wider than every
        decode hides nothing and counts as none)."""
        key = ("native_first", window)
        if key not in self._mask_cache:
            lens = self.decode_seq_lens_list or self.decode_seq_lens.tolist()
            if window_hides_nothing(window, lens):
                shared = self.shared_prefixes()
                first = [0] * len(lens)
                for group in shared:
                    for r in group.rows:
                        first[r] = group.num_blocks * self.block_size
            else:
                shared, first = [], [max(0, n - window) for n in lens]
            self._mask_cache[key] = (torch.tensor(first, dtype=torch.long), shared)
        return self._mask_cache[key]

    def _decode_route(self, q: torch.Tensor, k_cache: torch.Tensor, window: int | None) -> str:
        """decode_choice's kernel for this step's decodes ("native" or "torch"), once per
        step per window."""
        return self._route(q.dtype, q.shape[1], q.shape[2], k_cache, window)

    def fused_decode_first(self, dtype: torch.dtype, heads: int, head_dim: int,
                           k_cache: torch.Tensor, window: int | None) -> torch.Tensor | None:
        """The first key position of each decode [num_decodes] where this step's decodes (of
        queries in `dtype`, `heads` x `head_dim`) run the fused kernel alone, as
        `paged_decode_attention` takes it: route "native" and no shared prefix attended
        apart (what model/decode_stack.py runs); else None."""
        first, shared = self._first_positions(window)
        if shared or self._route(dtype, heads, head_dim, k_cache, window) != "native":
            return None
        return first

    def _route(self, dtype: torch.dtype, heads: int, head_dim: int, k_cache: torch.Tensor,
               window: int | None) -> str:
        key = ("decode_route", window)
        if key not in self._mask_cache:
            first, _ = self._first_positions(window)
            lens = self.decode_seq_lens_list or self.decode_seq_lens.tolist()
            cls = DecodeClass(dtype, heads, k_cache.shape[0], head_dim, k_cache.shape[2],
                              k_cache.dtype)
            longest = max(n - f for n, f in zip(lens, first.tolist(), strict=True))
            self._mask_cache[key] = decode_route(cls, len(lens), longest)
        return self._mask_cache[key]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scale: float, window: int | None, out: torch.Tensor) -> None:
        route = self._decode_route(q, k_cache, window)
        if route == "torch":
            out.copy_(decode_attention(q, k_cache, v_cache, self, scale, window))
            return
        first, shared = self._first_positions(window)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if shared else None
        torch.ops.pagedkv_cpu.paged_decode_attention(
            q, k_cache, v_cache, self.decode_block_tables, first, self.decode_seq_lens, scale,
            out, lse)
        tiled = tiled_prefill(q.shape[2], q.dtype) and k_cache.dtype == q.dtype
        amx = bool(shared) and self._amx_prefix(q, k_cache)
        for group in shared:
            rows = group.index()
            if amx and isinstance(rows, slice):  # views: merged in place, in the kernel
                torch.ops.pagedkv_cpu.amx_prefix_attention_merge_(
                    q[rows], k_cache, v_cache, group.block_ids, scale, out[rows], lse[rows])
                continue
            if amx:
                o_p, lse_p = amx_prefix(q[rows], k_cache, v_cache, group, scale)
            elif tiled:
                o_p, lse_p = prefix_attention(q, k_cache, v_cache, self.prefix_runs(group), scale)
                o_p, lse_p = o_p[rows], lse_p[rows]
            else:
                o_p, lse_p = shared_prefix_attention(q[rows], k_cache, v_cache, group, scale)
            out[rows] = merge_states(out[rows], lse[rows], o_p, lse_p)

    def _amx_prefix(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """prefill_choice.amx_prefix_ok for this step's shared prefixes, once per step."""
        if "amx_prefix" not in self._mask_cache:
            self._mask_cache["amx_prefix"] = amx_prefix_ok(q, k_cache)
        return self._mask_cache["amx_prefix"]

    def prefix_runs(self, group: SharedPrefix) -> PrefixRuns:
        """`prefix_runs` of `group`, once per step."""
        key = ("prefix_runs", tuple(group.rows))
        if key not in self._mask_cache:
            self._mask_cache[key] = prefix_runs(group, self.block_size)
        return self._mask_cache[key]


@dataclasses.dataclass(frozen=True)
class PrefillCascade:
    """Prefill chunks sharing a cached prefix, rows [start, end) of the batch (chunk after
    chunk), attended as a cascade on the fused kernels: each token over its own keys after the
    prefix by `paged_decode_attention` (a row per token: `tables`, `first` and `lens` [rows],
    causal by its length), then all of them over the prefix's blocks `block_ids` on AMX tiles,
    merged into that in place (`amx_prefix_attention_merge_`)."""

    start: int
    end: int
    tables: torch.Tensor
    first: torch.Tensor
    lens: torch.Tensor
    block_ids: torch.Tensor

    @classmethod
    def of(cls, chunks: list[PrefillChunk], group: SharedPrefix,
           block_size: int) -> PrefillCascade:
        """The cascade of `chunks` (consecutive in the batch), `group` their shared prefix."""
        width = max(len(c.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.long)
        for r, c in enumerate(chunks):
            tables[r, : len(c.block_table)] = c.block_table
        counts = torch.tensor([c.token_end - c.token_start for c in chunks])
        lens = torch.cat([torch.arange(c.start_pos + 1, c.seq_len + 1) for c in chunks])
        first = torch.full_like(lens, group.num_blocks * block_size)
        return cls(chunks[0].token_start, chunks[-1].token_end,
                   tables.repeat_interleave(counts, dim=0), first, lens, group.block_ids)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, out: torch.Tensor) -> None:
        """Writes rows [start, end) of `out` [T, heads, D] (contiguous); the chunks' K/V are
        in the cache."""
        rows = slice(self.start, self.end)
        o, qs = out[rows], q[rows]
        lse = torch.empty((self.end - self.start, q.shape[1]), dtype=torch.float32)
        torch.ops.pagedkv_cpu.paged_decode_attention(qs, k_cache, v_cache, self.tables,
                                                     self.first, self.lens, scale, o, lse)
        torch.ops.pagedkv_cpu.amx_prefix_attention_merge_(qs, k_cache, v_cache, self.block_ids,
                                                          scale, o, lse)


def amx_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               group: SharedPrefix, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [n, heads, D], lse [n, heads] float32) of the group's decodes q [n, heads, D] over
    its shared prefix, on AMX tiles (`amx_prefix_attention`)."""
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    torch.ops.pagedkv_cpu.amx_prefix_attention(q, k_cache, v_cache, group.block_ids, scale, out,
                                               lse)
    return out, lse


PrefixRuns = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def prefix_runs(group: SharedPrefix, block_size: int) -> PrefixRuns:
    """(block tables, first rows, end rows, lengths) of the chunks that `prefix_attention` gives
    the tiled kernel for `group`'s decodes: each run of consecutive rows one chunk, on the
    prefix's blocks, seeing the whole prefix."""
    runs = [[group.rows[0], group.rows[0] + 1]]
    for r in group.rows[1:]:
        if r == runs[-1][1]:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    bounds = torch.tensor(runs, dtype=torch.long)
    return (group.block_ids.view(1, -1).expand(len(runs), -1), bounds[:, 0], bounds[:, 1],
            torch.full((len(runs),), group.num_blocks * block_size, dtype=torch.long))


def prefix_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     runs: PrefixRuns, scale: float, k_scales: torch.Tensor | None = None,
                     v_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [S, heads, D], lse [S, heads] float32) of the decodes q [S, heads, D] over a shared
    prefix (`prefix_runs`; valid in its group's rows only): one call of the tiled kernel, not
    causal, reading the caches (of q's dtype, or int8 with its `k_scales` / `v_scales`, or fp8)
    in place. Mutates nothing."""
    tables, starts, ends, lens = runs
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    torch.ops.pagedkv_cpu.paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, ends, lens, 0, scale, out, False, lse, k_scales,
        v_scales)
    return out, lse


class CpuNativeBackend(TorchPagedBackend):
    """torch_paged's metadata, or the fused kernels' while `fused` is set (by the runner,
    between steps, once the kernels are loaded: `set_fused`)."""

    name = "cpu_native"

    def set_fused(self, on: bool) -> None:
        self.fused = on

    def build_metadata(self, step: StepSequences) -> AttentionMetadata:
        self.metadata_cls = NativeAttentionMetadata if self.fused else AttentionMetadata
        return super().build_metadata(step)
