"""The CUDA backend's Triton kernels against the dense float64 reference.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set
in tests/conftest.py before Triton is imported); with one, on CUDA. Shapes are small: the
interpreter runs every program in Python.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.model.driver import TRITON_DEVICE
from tests.model.test_attention import dense_reference

triton = pytest.importorskip("triton")

from pagedkv.model.backends.step import StepSequences  # noqa: E402
from pagedkv.model.backends.triton_paged import (  # noqa: E402
    TritonPagedBackend,
    store_kv,
)
from pagedkv.model.kv_int8 import quantize_into_per_token, round_trip_per_token  # noqa: E402
from pagedkv.model.kv_quant import KVScales, dequantize, quantize, quantize_into  # noqa: E402

DEVICE = TRITON_DEVICE


def make_step(seed, block_size, num_heads, num_kv_heads, head_dim, seqs, dtype):
    """seqs: (cached_len, num_new_tokens) per sequence, decodes (1 new token) first. Returns
    (q, k, v, caches, step, full K/V per sequence); the cached prefixes are already in the
    caches, in shuffled physical blocks (never block 0)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in seqs) + 4
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    qs, ks, vs, slots, tables, full = [], [], [], [], [], []
    for cached, new in seqs:
        table = [perm.pop() for _ in range(math.ceil((cached + new) / block_size))]
        kf = torch.randn(cached + new, num_kv_heads, head_dim, generator=gen).to(dtype)
        vf = torch.randn(cached + new, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(cached):
            k_cache[:, table[p // block_size], p % block_size] = kf[p]
            v_cache[:, table[p // block_size], p % block_size] = vf[p]
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(kf[cached:])
        vs.append(vf[cached:])
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
        tables.append(table)
        full.append((kf, vf))
    step = StepSequences(num_new_tokens=[n for _, n in seqs], seq_lens=[c + n for c, n in seqs],
                         block_tables=tables, slot_mapping=slots,
                         num_decodes=sum(n == 1 for _, n in seqs), block_size=block_size)
    # q as a strided view of a wider tensor, as the model passes it (a split of q/k/v).
    qkv = torch.cat([torch.cat(qs), torch.cat(ks), torch.cat(vs)], dim=1)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return q, k, v, (k_cache, v_cache), step, full


CASES = [
    # block_size, heads, kv_heads, head_dim, seqs, window
    (16, 4, 2, 16, [(5, 1), (40, 1), (0, 7)], None),  # decodes + a first prefill chunk, GQA 2
    (8, 4, 1, 32, [(19, 1), (3, 20)], None),  # MQA, a later chunk after a cached prefix
    (4, 6, 2, 16, [(30, 1), (9, 1), (6, 11)], 5),  # GQA 3 (not a power of 2), sliding window
    (16, 2, 2, 24, [(0, 33), (70, 1)], 16),  # head_dim not a power of 2, window = block size
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_paged_attention_matches_dense_reference(case):
    block_size, heads, kvh, d, seqs, window = CASES[case]
    seqs = sorted(seqs, key=lambda s: s[1] != 1)  # decodes first, as the runner orders them
    q, k, v, (k_cache, v_cache), step, full = make_step(case, block_size, heads, kvh, d, seqs,
                                                        torch.float32)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    meta = TritonPagedBackend(DEVICE).build_metadata(step)
    out = torch.full_like(q, float("nan"), device=DEVICE)  # every element must be written
    scale = d ** -0.5
    out = meta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, scale, window)
    tok = 0
    for (cached, new), (kf, vf) in zip(seqs, full, strict=True):
        ref = dense_reference(q[tok:tok + new], kf, vf, cached, window, scale)
        got = out[tok:tok + new].double().cpu()
        assert not got.isnan().any()
        err = (got - ref).norm() / ref.norm()
        assert err < 2e-3, (case, cached, new, float(err))  # tf32 dots on GPU: ~3e-4
        tok += new


@pytest.mark.parametrize("case", [0, 2])
def test_triton_kernel_soft_caps_the_scores(case):
    """Gemma 2's soft-capped attention through the seam its layers call (SoftcappedMetadata over
    the Triton metadata, which caps inside the kernel): the dense reference with the cap, far
    from the one without (a cap of 1.5 bends scores of this spread)."""
    from pagedkv.model.softcap_attention import SoftcappedMetadata

    block_size, heads, kvh, d, seqs, window = CASES[case]
    seqs = sorted(seqs, key=lambda s: s[1] != 1)
    q, k, v, (k_cache, v_cache), step, full = make_step(case, block_size, heads, kvh, d, seqs,
                                                        torch.float32)
    q = q * 4  # scores of a few units: the cap matters
    meta = SoftcappedMetadata(TritonPagedBackend(DEVICE).build_metadata(step), 1.5)
    scale = d ** -0.5
    out = meta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache.to(DEVICE),
                      v_cache.to(DEVICE), scale, window).double().cpu()
    tok = 0
    for (cached, new), (kf, vf) in zip(seqs, full, strict=True):
        ref = dense_reference(q[tok:tok + new], kf, vf, cached, window, scale, softcap=1.5)
        uncapped = dense_reference(q[tok:tok + new], kf, vf, cached, window, scale)
        got = out[tok:tok + new]
        assert (got - ref).norm() / ref.norm() < 2e-3, (case, cached, new)
        if cached + new > 1:  # one key: softmax is 1 whatever the score
            assert (uncapped - ref).norm() / ref.norm() > 2e-2, (case, cached, new)
        tok += new


def test_store_kv_writes_only_mapped_slots():
    gen = torch.Generator().manual_seed(7)
    kvh, blocks, bs, d = 3, 6, 4, 8
    k_cache = torch.randn(kvh, blocks, bs, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(kvh, blocks, bs, d, generator=gen).to(DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k = torch.randn(5, kvh, d, generator=gen).to(DEVICE)
    v = torch.randn(5, kvh, d, generator=gen).to(DEVICE)
    slots = torch.tensor([9, -1, 0, 23, 13], device=DEVICE)  # -1: a padding token, skipped
    store_kv(k, v, k_cache, v_cache, slots)
    k_want, v_want = k_before.view(kvh, -1, d).clone(), v_before.view(kvh, -1, d).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_want[:, s], v_want[:, s] = k[t], v[t]
    assert torch.equal(k_cache.view(kvh, -1, d), k_want)
    assert torch.equal(v_cache.view(kvh, -1, d), v_want)


# Triton's interpreter computes bfloat16 dots wrongly (numpy has no bfloat16): float16 there.
HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16


def test_half_precision_batch():
    """bfloat16 (float16 in the interpreter) caches, as the GPU runs: within half-precision
    rounding of the float64 reference."""
    seqs = [(c, 1) for c in (1, 17, 63, 64, 100)] + [(0, 12)]
    q, k, v, (k_cache, v_cache), step, full = make_step(11, 16, 8, 2, 64, seqs, HALF)
    meta = TritonPagedBackend(DEVICE).build_metadata(step)
    out = meta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache.to(DEVICE),
                      v_cache.to(DEVICE), 0.125, None)
    tok = 0
    for (cached, new), (kf, vf) in zip(seqs, full, strict=True):
        ref = dense_reference(q[tok:tok + new], kf, vf, cached, None, 0.125)
        err = (out[tok:tok + new].double().cpu() - ref).norm() / ref.norm()
        assert err < 1e-2, (cached, float(err))
        tok += new


def test_padded_rows_leave_real_rows_alone():
    """CUDA-graph padding: extra single-token sequences with slot -1 and seq_len 1 over the null
    block change nothing in the real rows or the cache."""
    seqs = [(10, 1), (3, 1)]
    q, k, v, (k_cache, v_cache), step, _ = make_step(3, 4, 4, 2, 16, seqs, torch.float32)
    meta = TritonPagedBackend(DEVICE).build_metadata(step)
    kc, vc = k_cache.to(DEVICE), v_cache.to(DEVICE)
    want = meta.attend(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kc.clone(), vc.clone(), 0.25, None)
    pad = StepSequences(num_new_tokens=[1] * 4, seq_lens=step.seq_lens + [1, 1],
                        block_tables=step.block_tables + [[0], [0]],
                        slot_mapping=step.slot_mapping + [-1, -1], num_decodes=4, block_size=4)
    padded = TritonPagedBackend(DEVICE).build_metadata(pad)
    zeros = torch.zeros(2, *q.shape[1:])
    kc2, vc2 = kc.clone(), vc.clone()
    got = padded.attend(torch.cat([q, zeros]).to(DEVICE), torch.cat([k, zeros[:, :2]]).to(DEVICE),
                        torch.cat([v, zeros[:, :2]]).to(DEVICE), kc2, vc2, 0.25, None)
    assert torch.equal(got[:2], want)
    kc.view(2, -1, 16)[:, step.slot_mapping] = k.to(DEVICE).transpose(0, 1)
    assert torch.equal(kc2, kc)


# Quantized caches read in place by the same kernels: (cache dtype, fp8 scales). int8 has its
# per-token-head scales beside the blocks; fp8 per-head scales (one per KV head, folded into q
# and the output by KVScales.attend) or one per layer.
QUANTIZED = {
    "int8": (torch.int8, None),
    "fp8_e4m3/per_head": (torch.float8_e4m3fn, KVScales(k_scale=(0.5, 4.0), v_scale=(2.0, 0.25))),
    "fp8_e5m2/per_head": (torch.float8_e5m2, KVScales(k_scale=(0.25, 2.0), v_scale=(1.0, 0.5))),
    "fp8_e4m3/per_layer": (torch.float8_e4m3fn, KVScales(k_scale=2.0, v_scale=0.5)),
}
# Decodes over several blocks, a first chunk and a chunk continuing a cached prefix that ends
# mid-block; GQA 3 (6 query heads on 2 KV heads), block size 4.
QUANTIZED_SEQS = [(21, 1), (6, 1), (0, 6), (9, 7)]


def _per_head(scale, device=DEVICE) -> torch.Tensor:
    """An fp8 scale (one per layer, or a tuple of one per KV head) as a [kv_heads or 1, 1]
    tensor dividing or multiplying K/V [T, kv_heads, D]."""
    return torch.tensor(scale, device=device).reshape(-1, 1)


def _stored(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """x [T, kv_heads, D] (float32) as a `dtype` cache gives it back (fp8: stored divided by
    `scale`, read back times it)."""
    if dtype == torch.int8:
        return round_trip_per_token(x)
    s = _per_head(scale, x.device)
    return dequantize(quantize(x / s, dtype), torch.float32) * s


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
@pytest.mark.parametrize("window", [None, 5])
def test_quantized_cache_read_in_place_matches_the_dequantized_reference(fmt, window):
    """The kernels over int8 / fp8 blocks (cached prefixes stored beforehand, the step's own
    K/V stored by store_kv) against the dense float64 attention over the dequantized K/V: the
    same values, so float32 rounding apart (well below the formats' own error, checked too)."""
    dtype, scales = QUANTIZED[fmt]
    seqs = QUANTIZED_SEQS
    q, k, v, (k32, _), step, full = make_step(5, 4, 6, 2, 16, seqs, torch.float32)
    k_cache = torch.zeros(k32.shape, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros(k32.shape, dtype=dtype, device=DEVICE)
    ks = vs = None
    if scales is None:
        ks = torch.zeros(k32.shape[:-1], device=DEVICE)
        vs = torch.zeros(k32.shape[:-1], device=DEVICE)
    bs = step.block_size
    for (cached, _), table, (kf, vf) in zip(seqs, step.block_tables, full, strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached)],
                             dtype=torch.long, device=DEVICE)
        if scales is None:
            quantize_into_per_token(k_cache, ks, slots, kf[:cached].to(DEVICE))
            quantize_into_per_token(v_cache, vs, slots, vf[:cached].to(DEVICE))
        else:
            quantize_into(k_cache, slots, kf[:cached].to(DEVICE) / _per_head(scales.k_scale))
            quantize_into(v_cache, slots, vf[:cached].to(DEVICE) / _per_head(scales.v_scale))
    meta = TritonPagedBackend(DEVICE).build_metadata(step)
    args = (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, 0.25, window)
    out = meta.attend(*args, k_scales=ks, v_scales=vs) if scales is None \
        else scales.attend(meta, *args)
    tol = 2e-3 if DEVICE.type == "cuda" else 1e-5  # tf32 dots on GPU; float32 in the interpreter
    tok = 0
    for (cached, new), (kf, vf) in zip(seqs, full, strict=True):
        kq = _stored(kf, dtype, scales and scales.k_scale)
        vq = _stored(vf, dtype, scales and scales.v_scale)
        ref = dense_reference(q[tok:tok + new], kq, vq, cached, window, 0.25)
        got = out[tok:tok + new].double().cpu()
        err = float((got - ref).norm() / ref.norm())
        assert err < tol, (fmt, cached, new, err)
        unquantized = dense_reference(q[tok:tok + new], kf, vf, cached, window, 0.25)
        assert float((unquantized - ref).norm() / ref.norm()) > 1e-3  # the format shows, err not
        tok += new
