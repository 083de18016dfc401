"""Cascade attention over an int8 or fp8 KV cache read in place (backends/quantized_native.py):
decodes sharing a cached prefix attend to its quantized blocks once per group through the tiled
kernel (not causal, with log-sum-exp), merged with their own blocks' part from the decode
kernel; every row equal to the same step without the cascade split and to softmax attention
over the dequantized cache."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from pagedkv.kernels.cpu import ensure_cpu_kernels
from pagedkv.model.backends import quantized_native
from pagedkv.model.backends.cpu_native import CpuNativeBackend
from pagedkv.model.backends.quantized import QuantizedKVBackend
from pagedkv.model.backends.quantized_native import InPlaceMetadata
from pagedkv.model.backends.step import StepSequences
from tests.model.test_kv_quant_in_place import _fill, _reference

KV_HEADS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 2, 4, 64, 16, 32
PREFIX_1, PREFIX_2 = [3, 8, 5, 10], [18, 19, 20, 21]  # 64 tokens each (cascade.MIN_SHARED_TOKENS)
# (new tokens, sequence length, block table): six decodes, two groups sharing a prefix with
# suffixes of 5, 20, 1, 3 and 16 tokens (rows 0, 2, 3 and rows 4, 5), one decode of its own
# (row 1, between them), then a prefill chunk that hit PREFIX_1 in the prefix cache.
SEQS = [(1, 69, PREFIX_1 + [12]), (1, 70, [1, 2, 4, 6, 7]), (1, 84, PREFIX_1 + [13, 14]),
        (1, 65, PREFIX_1 + [15]), (1, 67, PREFIX_2 + [22]), (1, 80, PREFIX_2 + [23]),
        (6, 70, PREFIX_1 + [16])]
NUM_DECODES = 6
FORMATS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _tolerance(cache_dtype, dtype):
    """Relative error allowed between two attentions over the same stored values: one bfloat16
    rounding of the output; float32 sums in another order, or, for int8, the decode kernel's
    int16 copy of q (int8 keys meet q in integers: 2^-15 of q's largest value)."""
    if dtype == torch.bfloat16:
        return 1e-2
    return 1e-4 if cache_dtype == torch.int8 else 2e-6


def _slot(table, pos):
    return table[pos // BLOCK] * BLOCK + pos % BLOCK


def _caches(cache_dtype, gen):
    """K/V caches (and int8 scales) holding random values at every cached position."""
    shape = (KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    k_scales = v_scales = None
    if cache_dtype == torch.int8:
        k_scales, v_scales = torch.zeros(shape[:-1]), torch.zeros(shape[:-1])
    cached = torch.tensor(sorted({_slot(t, p) for n, s, t in SEQS for p in range(s - n)}))
    for cache, scales in ((k_cache, k_scales), (v_cache, v_scales)):
        _fill(cache, scales, cached, torch.randn(len(cached), KV_HEADS, HEAD_DIM, generator=gen))
    return k_cache, v_cache, k_scales, v_scales


@contextmanager
def cascade_spy(monkeypatch, cascade: bool):
    """Within: the rows of every quantized prefix_attention call are appended to the list it
    yields; with `cascade` False no shared prefix is found (the step without the split)."""
    calls = []
    real = quantized_native.prefix_attention
    with monkeypatch.context() as m:
        m.setattr(quantized_native, "prefix_attention",
                  lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
        if not cascade:
            m.setattr(quantized_native, "find_shared_prefixes", lambda *a, **kw: [])
        yield calls


def _step():
    return StepSequences(num_new_tokens=[n for n, _, _ in SEQS], seq_lens=[s for _, s, _ in SEQS],
                         block_tables=[t for _, _, t in SEQS],
                         slot_mapping=[_slot(t, p) for n, s, t in SEQS for p in range(s - n, s)],
                         num_decodes=NUM_DECODES, block_size=BLOCK)


def _attend(cache_dtype, dtype, window, cascade, monkeypatch):
    """(out, caches after the step, prefix_attention calls) of one step through the in-place
    metadata, with or without the cascade split (the same random inputs every call)."""
    ensure_cpu_kernels("wait")
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, k_scales, v_scales = _caches(cache_dtype, gen)
    t = sum(n for n, _, _ in SEQS)
    q, k, v = (torch.randn(t, h, HEAD_DIM, generator=gen).to(dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    with cascade_spy(monkeypatch, cascade) as calls:
        backend = QuantizedKVBackend(CpuNativeBackend(torch.device("cpu")), reads_in_place=True)
        backend.set_fused(True)
        meta = backend.build_metadata(_step())
        assert isinstance(meta, InPlaceMetadata) and meta.num_decodes == NUM_DECODES
        out = meta.attend(q, k, v, k_cache, v_cache, HEAD_DIM ** -0.5, window,
                          k_scales=k_scales, v_scales=v_scales)
        groups = [g.rows for g in meta.shared_prefixes(window)]
    return out, (q, k_cache, v_cache, k_scales, v_scales), calls, groups


@pytest.mark.parametrize("cache_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
def test_cascade_equals_the_uncascaded_quantized_path(cache_dtype, dtype, window, monkeypatch):
    """Two groups (one not consecutive: a decode of its own between its rows), suffixes of
    different lengths (1 token to a whole block), a prefill chunk that hit the prefix cache
    in the same step: the cascade's rows equal the step without it (the same quantized values
    read) and attention over the dequantized cache. A window wider than every decode hides
    nothing and keeps the cascade."""
    ensure_cpu_kernels("wait")
    if not torch.ops.pagedkv_cpu.paged_prefill_supports(HEAD_DIM, dtype):
        pytest.skip("this build has no tiled kernel for the dtype (no cascade in place)")
    out, inputs, calls, groups = _attend(cache_dtype, dtype, window, True, monkeypatch)
    assert groups == [[0, 2, 3], [4, 5]]
    assert calls == [NUM_DECODES, NUM_DECODES]  # one tiled call per group (its rows' runs)
    plain, plain_inputs, plain_calls, plain_groups = _attend(cache_dtype, dtype, window, False,
                                                             monkeypatch)
    assert plain_calls == [] and plain_groups == []
    for a, b in zip(inputs[1:], plain_inputs[1:], strict=True):  # the same cache written
        assert b is None or torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                        b.view(torch.uint8) if b.dtype != torch.float32 else b)
    tol = _tolerance(cache_dtype, dtype)
    err = float((out.float() - plain.float()).abs().max() / plain.float().abs().max())
    assert err < tol, err
    ref = _reference(*inputs, window, SEQS)
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    assert err < tol, err


@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_a_window_that_hides_keys_turns_the_cascade_off(cache_dtype, monkeypatch):
    """With a sliding window narrower than the decodes no prefix is split off (every row sees
    only its window); the rows still equal attention over the dequantized cache."""
    out, inputs, calls, groups = _attend(cache_dtype, torch.float32, 24, True, monkeypatch)
    assert groups == [] and calls == []
    ref = _reference(*inputs, 24, SEQS)
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < _tolerance(cache_dtype, torch.float32), err
