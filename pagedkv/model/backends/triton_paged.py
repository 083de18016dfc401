"""The CUDA attention backend: two Triton launches per layer whatever the number of requests.

Per layer: `store_kv` writes the step's new K/V into their slots (one program per token), then
`paged_attention` attends every query token of the step, decodes and prefill chunks together,
reading K/V in place through the block tables (triton_kernels.py). The per-step metadata is a
handful of small int32 tensors, so a decode step of a fixed batch size can be captured in a CUDA
graph (cuda_graphs.py) by filling the same tensors in place.

Why Triton kernels of our own rather than FlexAttention or FlashInfer: one kernel handles the
mixed batch (no block mask to rebuild per step, no 17 s compile), it runs under Triton's
interpreter on CPU so CI tests its logic, and FlashInfer is a large binary dependency tied to
CUDA/torch versions. Triton ships with torch's CUDA wheels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from pagedkv.config.dtypes import FP8_TORCH_DTYPE_NAMES, INT8_KV_DTYPE
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.backends.table_rows import BlockTableRows
from pagedkv.model.backends.triton_int8_store import store_kv_int8
from pagedkv.model.backends.triton_kernels import paged_attention_kernel, store_kv_kernel
from pagedkv.model.kv_quant import is_quantized, quantize

DECODE_BLOCK_M = 16  # query rows (tokens x query heads of one KV head) per program, decode
PREFILL_BLOCK_M = 64  # the same when some sequence has several query tokens
TILE_N = 64  # key positions per inner-loop tile
NO_WINDOW = 1 << 30  # "window" of a layer without a sliding window


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Store k, v [T, kv_heads, head_dim] (strided views allowed, last dim contiguous) into
    slots `slot_mapping` [T] of k_cache / v_cache [kv_heads, num_blocks, block_size, head_dim]
    (mutated); tokens with slot -1 are skipped. For an fp8 cache the values are converted first
    (kv_quant.quantize: saturating, round to nearest even; the scales are the caller's,
    kv_quant.KVScales): Triton's interpreter rounds values just below a power of two down to
    half of it when it converts to fp8, so the kernel only copies bytes. An int8 cache
    (k_scales / v_scales given, [kv_heads, num_blocks, block_size] float32, mutated) gets
    kv_int8's per-token values and scales, searched, quantized and stored by one launch
    (triton_int8_store.py; no data-dependent shapes: CUDA-graph safe)."""
    t, kvh, d = k.shape
    if t == 0:
        return
    if k_scales is not None:
        store_kv_int8(k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping)
        return
    if is_quantized(k_cache.dtype):  # converted by torch: Triton's interpreter rounds fp8 wrong
        k, v = quantize(k, k_cache.dtype), quantize(v, v_cache.dtype)
    store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), NUM_KV_HEADS=kvh, HEAD_DIM=d,
        KV_HEADS_PAD=triton.next_power_of_2(kvh), HEAD_DIM_PAD=triton.next_power_of_2(d))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                    window: int | None, out: torch.Tensor | None = None,
                    k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attention output [T, heads, head_dim] of q [T, heads, head_dim] (last dim contiguous).

    Sequence i owns tokens query_start_loc[i] .. query_start_loc[i + 1] - 1 [S + 1], the last of
    its seq_lens[i] [S] positions, whose K/V (these tokens' included) are in the cache blocks
    block_tables[i] [S, width] (int32). `max_query_len` only picks the tile shape. Written into
    `out` when given. int8 caches: their per-slot scales k_scales / v_scales [kv_heads,
    num_blocks, block_size] (float32). `softcap` (Gemma 2): scores s become
    softcap * tanh(s / softcap)."""
    t, heads, d = q.shape
    kvh, _, block_size, _ = k_cache.shape
    group = heads // kvh
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    block_m = max(DECODE_BLOCK_M if max_query_len <= 1 else PREFILL_BLOCK_M,
                  triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (t // block_q + num_seqs, kvh)
    paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, num_seqs,
        NO_WINDOW if window is None else window, 1.0 if softcap is None else softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        block_tables.stride(0),
        k_cache if k_scales is None else k_scales, v_cache if v_scales is None else v_scales,
        0 if k_scales is None else k_scales.stride(0),
        NUM_QUERIES_PER_KV=group, BLOCK_SIZE=block_size, HEAD_DIM=d,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(d)), BLOCK_Q=block_q, BLOCK_M=block_m,
        TILE_N=TILE_N,
        # float32 caches: exact float32 products (as torch's float32 matmuls), not tf32.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SCALES=k_scales is not None, HAS_SOFTCAP=softcap is not None)
    return out


@dataclass
class TritonAttentionMetadata:
    """One step's inputs for every layer: slot_mapping [T] (int64, -1 = do not store),
    block_tables [S, width], seq_lens [S], query_start_loc [S + 1] (int32, on the device).
    The tensors may be slices of buffers a CUDA graph replays from; they stay valid for the
    step."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    # The kernel soft-caps scores itself (softcap_attention.SoftcappedMetadata asks for it).
    caps_scores = True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None,
               k_scales: torch.Tensor | None = None,
               v_scales: torch.Tensor | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """Store k, v into the caches (mutated; int8: and their scales into k_scales /
        v_scales), then attend q through the block tables, scores soft-capped at `softcap`
        when given."""
        store_kv(k, v, k_cache, v_cache, self.slot_mapping, k_scales, v_scales)
        return paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens,
                               self.query_start_loc, self.max_query_len, scale, window,
                               k_scales=k_scales, v_scales=v_scales, softcap=softcap)


def reads_fp8_cache(device: torch.device) -> bool:
    """Whether the kernels can read an fp8 cache in place on `device` (fp8 loads converted in
    the attention kernel; stores convert with kv_quant.quantize first): Triton's fp8 types
    need compute capability 8.9 (Ada, Hopper) or later; the interpreter (CPU) always can."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


class TritonPagedBackend:
    """Builds `TritonAttentionMetadata` from the runner's step description."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fused = False  # no fused CPU kernels
        # int8 values and their per-token scales are loaded by the kernel; fp8 where Triton
        # has it (`reads_fp8_cache`).
        self.reads_cache_dtypes = frozenset(
            {INT8_KV_DTYPE, *(FP8_TORCH_DTYPE_NAMES if reads_fp8_cache(device) else ())})
        self._tables = BlockTableRows(torch.int32)  # reused across steps (table_rows.py)

    def set_fused(self, on: bool) -> None:
        """No fused CPU kernels: nothing to switch."""

    def build_metadata(self, step: StepSequences) -> TritonAttentionMetadata:
        """Device tensors for `step` (one host-to-device copy per field)."""
        dev = self.device
        starts = [0]
        for n in step.num_new_tokens:
            starts.append(starts[-1] + n)
        return TritonAttentionMetadata(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=dev),
            block_tables=self._tables.build(step.block_tables).to(dev),
            seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(step.num_new_tokens, default=0))
