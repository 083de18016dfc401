"""Whole steps over an int8 or fp8 KV cache read in place by the fused CPU kernel: decodes,
prefill chunks from position 0 and chunks continuing a cached prefix, every token one row of
the kernel (backends/quantized_native.py), against softmax attention over the dequantized cache;
a step with an unstored token sends its prefill chunks through the compact copy instead."""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.backends.cpu_native import CpuNativeBackend
from pagedkv.model.backends.quantized import QuantizedKVBackend, QuantizedKVMetadata
from pagedkv.model.backends.quantized_native import InPlaceMetadata
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.kv_int8 import dequantize_per_token, quantize_into_per_token
from pagedkv.model.kv_quant import dequantize, quantize_into

KV_HEADS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 4, 64, 4, 24
# (new tokens, sequence length, block table): a decode, a chunk from position 0, a chunk after 9
# cached tokens (positions 9..13), each sequence in its own shuffled blocks.
SEQS = [(1, 13, [3, 7, 9, 11]), (6, 6, [5, 6]), (5, 14, [12, 20, 14, 15])]


def _fill(cache, scales, slots, values):
    if scales is None:
        quantize_into(cache, slots, values)
    else:
        quantize_into_per_token(cache, scales, slots, values)


def _dequantized(cache, scales):
    return dequantize(cache, torch.float32) if scales is None else \
        dequantize_per_token(cache, scales, torch.float32)


def _reference(q, k_cache, v_cache, k_scales, v_scales, window, seqs=SEQS):
    """Softmax attention of every token of `seqs` over its sequence's dequantized cache rows
    (the block size the caches')."""
    keys = _dequantized(k_cache, k_scales).flatten(1, 2)
    values = _dequantized(v_cache, v_scales).flatten(1, 2)
    out, row, g, bs = torch.zeros(q.shape), 0, q.shape[1] // k_cache.shape[0], k_cache.shape[2]
    for n, seq_len, table in seqs:
        for pos in range(seq_len - n, seq_len):
            first = 0 if window is None else max(0, pos + 1 - window)
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(first, pos + 1)])
            for h in range(HEADS):
                k, v = keys[h // g, slots], values[h // g, slots]
                out[row, h] = torch.softmax(k @ q[row, h].float() * q.shape[2] ** -0.5, 0) @ v
            row += 1
    return out


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("unstored", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_every_token_of_a_step_reads_the_quantized_cache_in_place(cache_dtype, window, unstored,
                                                                   dtype):
    """The decode through the decode kernel, the prefill chunks (from 0, after a cached prefix)
    through the tiled prefill kernel where the build has it (else, float16 always, a row of the
    decode kernel per token): every row equal to attention over the dequantized cache."""
    ensure_cpu_kernels("wait")
    gen = torch.Generator().manual_seed(1)
    shape = (KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    k_scales = v_scales = None
    if cache_dtype == torch.int8:
        k_scales, v_scales = torch.zeros(shape[:-1]), torch.zeros(shape[:-1])
    cached = [t[p // BLOCK] * BLOCK + p % BLOCK for n, s, t in SEQS for p in range(s - n)]
    cached = torch.tensor(cached)
    for cache, scales in ((k_cache, k_scales), (v_cache, v_scales)):
        _fill(cache, scales, cached, torch.randn(len(cached), KV_HEADS, HEAD_DIM, generator=gen))
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for n, s, t in SEQS for p in range(s - n, s)]
    if unstored:  # a chunk token not stored: only the decode is read in place
        slots[1] = -1
    step = StepSequences(num_new_tokens=[n for n, _, _ in SEQS], seq_lens=[s for _, s, _ in SEQS],
                         block_tables=[t for _, _, t in SEQS], slot_mapping=slots, num_decodes=1,
                         block_size=BLOCK)
    backend = QuantizedKVBackend(CpuNativeBackend(torch.device("cpu")), reads_in_place=True)
    backend.set_fused(True)
    meta = backend.build_metadata(step)
    assert isinstance(meta, InPlaceMetadata)
    assert meta.num_rows == (1 if unstored else len(slots))
    assert isinstance(meta.prefill, QuantizedKVMetadata) == unstored
    assert meta.num_decodes == 1 and (meta.chunks is None) == unstored
    if not unstored:  # the two chunks: rows 1..6 and 7..11 of the step, their own tables
        starts, ends, lens, tables = meta.chunks
        assert starts.tolist() == [1, 7] and ends.tolist() == [7, 12] and lens.tolist() == [6, 14]
        assert tables[0, :2].tolist() == [5, 6] and tables[1].tolist() == [12, 20, 14, 15]
    t = len(slots)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    before = k_cache.clone()
    out = meta.attend(q, k, v, k_cache, v_cache, HEAD_DIM ** -0.5, window,
                      k_scales=k_scales, v_scales=v_scales)
    written = (k_cache.view(torch.uint8) != before.view(torch.uint8)).any(-1).flatten(1).any(0)
    assert set(written.nonzero().flatten().tolist()) <= {s for s in slots if s >= 0}
    ref = _reference(q, k_cache, v_cache, k_scales, v_scales, window)
    rows = 1 if unstored else t  # an unstored token's chunk reads it from the compact copy
    err = float((out[:rows].float() - ref[:rows]).abs().max() / ref[:rows].abs().max())
    assert err < 1e-2, err  # a bfloat16 output's rounding


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shared", [False, True])
def test_every_fp8_value_widens_exactly(cache_dtype, shared):
    """Every finite fp8 byte (subnormals, both signs) as a value read in place: row r's key r
    outscores the earlier ones by 128 nats, so its output is value row r itself, widened in
    registers (`shared` False: each row its own block) or in a tile's widened copy (True: the
    rows of one block table). NaN / inf bytes are left out (the writes saturate)."""
    ensure_cpu_kernels("wait")
    rows, d = 4, 64
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = torch.isfinite(codes.view(cache_dtype).float())
    values = torch.where(finite, codes, torch.zeros_like(codes)).view(rows, d)
    shape = (1, rows + 1, BLOCK, d)
    k_cache, v_cache = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    keys = torch.zeros(rows, d)
    keys[:, 0] = 128.0 * torch.arange(rows)
    if shared:  # rows 0..3 are the first 4 positions of block 1
        tables, lens = [[1]] * rows, list(range(1, rows + 1))
        v_cache[0, 1, :rows], k_cache[0, 1, :rows] = values, keys.to(cache_dtype).view(torch.uint8)
    else:  # row r is position 0 of block r + 1
        tables, lens = [[r + 1] for r in range(rows)], [1] * rows
        v_cache[0, 1:, 0], k_cache[0, 1:, 0] = values, keys.to(cache_dtype).view(torch.uint8)
    q = torch.zeros(rows, 1, d)
    q[:, 0, 0] = 1.0
    out = torch.full_like(q, float("nan"))
    torch.ops.pagedkv_cpu.paged_decode_attention_q(
        q, k_cache.view(cache_dtype), v_cache.view(cache_dtype), None, None,
        torch.tensor(tables), torch.zeros(rows, dtype=torch.long), torch.tensor(lens), 1.0, out,
        None)
    # The outscored keys' weights are the kernel's fast exp floor (~1e-38), not exp(-128):
    # 1e-30 is far below the smallest fp8 value (2^-16), so this is exact per value.
    torch.testing.assert_close(out[:, 0], values.view(cache_dtype).float(), rtol=0, atol=1e-30)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fp8_write_kernel_writes_what_torch_writes_bit_for_bit(cache_dtype, dtype):
    """write_kv_fp8_ (the in-place step's fp8 write) against kv_quant.quantize_into: values of
    every magnitude (fp8 subnormals to past the format's range, +-inf: saturated), shuffled
    slots, one negative slot skipped, every other byte untouched."""
    ensure_cpu_kernels("wait")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(90, KV_HEADS, HEAD_DIM, generator=gen)
    x *= torch.exp2(torch.randint(-24, 18, (90, KV_HEADS, 1), generator=gen).float())
    x[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), 1e6])
    x = x.to(dtype)
    slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen)[:90]
    shape = (KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)
    ref, got = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    quantize_into(ref, slots, x)
    torch.ops.pagedkv_cpu.write_kv_fp8_(x, got, slots)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert int(ref.view(torch.uint8).ne(0).sum()) > 90 * KV_HEADS * HEAD_DIM // 2
    before = got.clone()
    torch.ops.pagedkv_cpu.write_kv_fp8_(x[:1] * 2, got, torch.tensor([-1]))
    assert torch.equal(got.view(torch.uint8), before.view(torch.uint8))
