"""Any attention backend over a KV cache stored in another format than the model computes in (fp8,
int8 with per-token scales, or a 16-bit cache of a float32 model): quantize on write, dequantize
the step's blocks before the wrapped backend attends.

`QuantizedKVBackend(inner)` renumbers a step's blocks compactly (the null block 0 stays 0; the
step's other blocks become 1..n in ascending order, so equal blocks stay equal and cascade
attention still finds shared prefixes) and builds the inner backend's metadata for that compact
step. Per layer, `QuantizedKVMetadata.attend` writes the new K/V as fp8 into their real slots
(kv_quant.quantize_into), dequantizes the step's blocks into a compact cache of the model's
dtype (float32 for int8: an int8 value times its float32 scale is not a 16-bit float, and the
in-place kernel attends in float32 too) and lets the inner backend attend over it; the step's
own tokens are attended as the cache will return them (kv_quant.round_trip), so a token reads
the same whether it was computed in this step or an earlier one. The runner wraps a backend in this unless it reads fp8 in place itself
(`reads_cache_dtypes`) or the model's attention stores and reads the cache itself (Gemma 2's
soft-capping, softcap_attention.py, which shares `store_kv`): the CPU one (torch_paged) is wrapped; the CUDA one (triton_paged) converts
inside its kernels on GPUs of compute capability 8.9+ (and under the interpreter) and is wrapped
on older GPUs (then without CUDA graphs, see ModelRunner.capture_cuda_graphs). A backend that
reads fp8 in place elsewhere calls kv_quant.dequantize inside its own gather.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedkv.model.backends.base import AttentionBackend
from pagedkv.model.backends.quantized_native import InPlaceMetadata
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.kv_int8 import (
    dequantize_per_token,
    quantize_into_per_token,
    quantize_per_token,
)
from pagedkv.model.kv_quant import dequantize, quantize_into, round_trip


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Store k, v [T, kv_heads, D] in slots `slot_mapping` [T] (int64, all >= 0) of k_cache /
    v_cache in the cache's format (mutated): int8 with their per-token scales into k_scales /
    v_scales (mutated; kv_int8.py), else converted to the cache's float dtype, saturating at
    its largest finite value (fp8: any scales already divided out; kv_quant.py)."""
    if k_scales is not None:
        quantize_into_per_token(k_cache, k_scales, slot_mapping, k)
        quantize_into_per_token(v_cache, v_scales, slot_mapping, v)
    else:
        quantize_into(k_cache, slot_mapping, k)
        quantize_into(v_cache, slot_mapping, v)


def compact_step(step: StepSequences) -> tuple[StepSequences, list[int]]:
    """(the step with blocks renumbered 0..n, the original id of each compact id). Slots < 0
    (tokens not stored) stay as they are."""
    used = sorted({b for table in step.block_tables for b in table} | {0})
    index = {b: i for i, b in enumerate(used)}
    bs = step.block_size
    tables = [[index[b] for b in table] for table in step.block_tables]
    slots = [s if s < 0 else index[s // bs] * bs + s % bs for s in step.slot_mapping]
    return replace(step, block_tables=tables, slot_mapping=slots), used


@dataclass
class QuantizedKVMetadata:
    """The inner backend's metadata for the compact step, plus what maps it to the real cache:
    `used_blocks` [n] (real id of each compact block), `slot_mapping` [T'] (real slots of the
    stored tokens) and `stored_tokens` [T'] (their rows in the batch; None: every row)."""

    inner: Any
    used_blocks: torch.Tensor
    slot_mapping: torch.Tensor
    stored_tokens: torch.Tensor | None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None,
               k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Store k, v [T, kv_heads, D] in the cache's format into k_cache / v_cache (and, for
        int8, their per-token scales into k_scales / v_scales; all mutated), attend q
        [T, heads, D] over the dequantized blocks of the step."""
        rows = self.stored_tokens
        k_in = k if rows is None else k[rows]
        v_in = v if rows is None else v[rows]
        used = self.used_blocks
        store_kv(k_in, v_in, k_cache, v_cache, self.slot_mapping, k_scales, v_scales)
        if k_scales is not None:  # int8, per-token-head scales (kv_int8.py)
            f32 = torch.float32
            k_blocks = dequantize_per_token(k_cache.index_select(1, used),
                                            k_scales.index_select(1, used), f32)
            v_blocks = dequantize_per_token(v_cache.index_select(1, used),
                                            v_scales.index_select(1, used), f32)
            k_step = dequantize_per_token(*quantize_per_token(k), f32)
            v_step = dequantize_per_token(*quantize_per_token(v), f32)
            out = self.inner.attend(q.to(f32), k_step, v_step, k_blocks, v_blocks, scale, window)
            return out.to(q.dtype)
        else:
            k_blocks = dequantize(k_cache.index_select(1, used), q.dtype)
            v_blocks = dequantize(v_cache.index_select(1, used), q.dtype)
            k_step, v_step = round_trip(k, k_cache.dtype), round_trip(v, v_cache.dtype)
        return self.inner.attend(q, k_step, v_step, k_blocks, v_blocks, scale, window)


class QuantizedKVBackend:
    """Wraps the device's backend (`inner`) for an fp8 KV cache (module docstring)."""

    supports_cuda_graphs = False  # its metadata is rebuilt (compact blocks) every step
    reads_cache_dtypes: frozenset[str] = frozenset()  # it is what reads the others

    def __init__(self, inner: AttentionBackend, reads_in_place: bool = False) -> None:
        """`reads_in_place`: the cache is int8 or fp8, which the fused CPU kernel reads in
        place while the fused kernels are on (quantized_native.py)."""
        self.inner = inner
        self.reads_in_place = reads_in_place
        self.name = inner.name
        self.device = inner.device

    @property
    def fused(self) -> bool:
        """Whether the inner backend's fused kernels run (cpu_native's, switched by the runner
        between steps; False for a backend without them): with them on, the fused kernels
        attend over the compact model-dtype copy."""
        return self.inner.fused

    def set_fused(self, on: bool) -> None:
        self.inner.set_fused(on)

    def build_metadata(self, step: StepSequences) -> QuantizedKVMetadata | InPlaceMetadata:
        """With the fused CPU kernels on: every token read in place (quantized_native.py);
        otherwise the inner metadata of the compact step and the real blocks and slots behind
        it."""
        if self.reads_in_place and self.fused:
            return self._in_place_metadata(step)
        return self._compact_metadata(step)

    def _compact_metadata(self, step: StepSequences) -> QuantizedKVMetadata:
        compact, used = compact_step(step)
        dev = self.device
        stored = [t for t, s in enumerate(step.slot_mapping) if s >= 0]
        rows = None if len(stored) == len(step.slot_mapping) else torch.tensor(stored, device=dev)
        return QuantizedKVMetadata(
            inner=self.inner.build_metadata(compact),
            used_blocks=torch.tensor(used, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor([step.slot_mapping[t] for t in stored], dtype=torch.long,
                                      device=dev),
            stored_tokens=rows)

    def _in_place_metadata(self, step: StepSequences) -> InPlaceMetadata | QuantizedKVMetadata:
        """Every token a row of the in-place kernel; when some token is not stored (slot < 0),
        only the decodes, and the prefill chunks through the compact path."""
        num_seqs = len(step.num_new_tokens)
        if min(step.slot_mapping, default=0) < 0:
            num_seqs = step.num_decodes
        prefill = None
        if num_seqs < len(step.num_new_tokens):
            prefill = self._compact_metadata(replace(
                step, num_new_tokens=step.num_new_tokens[num_seqs:],
                seq_lens=step.seq_lens[num_seqs:], block_tables=step.block_tables[num_seqs:],
                slot_mapping=step.slot_mapping[sum(step.num_new_tokens[:num_seqs]):],
                num_decodes=0))
        if num_seqs == 0:
            return prefill
        return InPlaceMetadata.for_step(step, num_seqs, prefill, self.device)
