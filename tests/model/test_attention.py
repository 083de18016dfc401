"""Paged attention against a dense reference on random inputs over many shapes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.model import attention
from pagedkv.model.attention import AttentionMetadata, PrefillChunk, paged_attention


def dense_reference(q, k, v, start_pos, window, scale):
    """q [n, H, D] at positions start_pos.., k/v [L, KVH, D] for positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos = torch.arange(start_pos, start_pos + q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    mask = j <= pos
    if window is not None:
        mask &= j > pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(seed, block_size, num_heads, num_kv_heads, seqs, window, dtype=torch.float32):
    """seqs: list of (cached_prefix_len, num_new_tokens). Returns (paged, reference) outputs."""
    gen = torch.Generator().manual_seed(seed)
    d = 16
    total_blocks = sum(math.ceil((c + n) / block_size) for c, n in seqs) + 1
    num_blocks = total_blocks + 3
    k_cache = torch.zeros(num_kv_heads, num_blocks, block_size, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    # Shuffled physical blocks (never block 0, the null block).
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][1] != 1)  # decodes first
    qs, ks, vs, slots, refs, full_kv = [], [], [], [], {}, {}
    tables = {}
    for i, (cached, new) in enumerate(seqs):
        n_blocks = math.ceil((cached + new) / block_size)
        tables[i] = [perm.pop() for _ in range(n_blocks)]
        kf = torch.randn(cached + new, num_kv_heads, d, generator=gen).to(dtype)
        vf = torch.randn(cached + new, num_kv_heads, d, generator=gen).to(dtype)
        full_kv[i] = (kf, vf)
        for p in range(cached):  # the cached prefix is already in the cache
            b, o = tables[i][p // block_size], p % block_size
            k_cache[:, b, o], v_cache[:, b, o] = kf[p], vf[p]
    scale = d ** -0.5
    prefills, num_decodes, tok = [], 0, 0
    for i in order:
        cached, new = seqs[i]
        kf, vf = full_kv[i]
        q = torch.randn(new, num_heads, d, generator=gen).to(dtype)
        qs.append(q)
        ks.append(kf[cached:])
        vs.append(vf[cached:])
        slots += [tables[i][p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
        refs[i] = (tok, dense_reference(q, kf, vf, cached, window, scale))
        if new == 1:
            num_decodes += 1
        else:
            prefills.append(PrefillChunk(tok, tok + new, cached, cached + new,
                                         torch.tensor(tables[i])))
        tok += new
    decodes = [i for i in order if seqs[i][1] == 1]
    max_b = max((len(tables[i]) for i in decodes), default=0)
    dec_tables = torch.zeros(len(decodes), max_b, dtype=torch.long)
    for r, i in enumerate(decodes):
        dec_tables[r, : len(tables[i])] = torch.tensor(tables[i])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=num_decodes,
        decode_seq_lens=torch.tensor([seqs[i][0] + 1 for i in decodes]),
        decode_block_tables=dec_tables, prefills=prefills, block_size=block_size,
        decode_seq_lens_list=[seqs[i][0] + 1 for i in decodes] if seed % 2 else [])
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta,
                          scale, window)
    ref = torch.empty(out.shape, dtype=torch.float64)
    for i in order:
        start, r = refs[i]
        ref[start:start + r.shape[0]] = r
    # The new K/V landed in their slots.
    for i, (cached, new) in enumerate(seqs):
        kf, _ = full_kv[i]
        for p in range(cached + new):
            assert torch.equal(k_cache[:, tables[i][p // block_size], p % block_size], kf[p])
    return out, ref


@pytest.mark.parametrize("block_size", [1, 2, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_mixed_batch_matches_dense(block_size, group, window):
    seqs = [(0, 1), (0, 7), (3, 1), (37, 1), (70, 1), (5, 9), (33, 20), (64, 1), (0, 50),
            (100, 3), (17, 1)]
    out, ref = run_case(block_size * 10 + group, block_size, 2 * group, 2, seqs, window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    gen = torch.Generator().manual_seed(1000 + seed)

    def ri(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    block_size = [1, 2, 16, 32][ri(0, 3)]
    group = [1, 2, 4][ri(0, 2)]
    window = [None, ri(1, 64)][ri(0, 1)]
    seqs = [(ri(0, 200), [1, ri(2, 40)][ri(0, 1)]) for _ in range(ri(1, 12))]
    num_kv_heads = ri(1, 2)
    out, ref = run_case(seed, block_size, group * num_kv_heads, num_kv_heads, seqs, window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_bfloat16_close_to_dense():
    seqs = [(0, 1), (20, 1), (0, 30), (45, 12), (300, 1)]
    out, ref = run_case(7, 16, 8, 2, seqs, None, dtype=torch.bfloat16)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("gather_bytes", [1, 4096])
def test_decode_groups_split_by_gather_budget(monkeypatch, gather_bytes):
    """Decodes processed one per group (or a few) give the same result as one big group."""
    monkeypatch.setattr(attention, "GATHER_BYTES", gather_bytes)
    seqs = [(0, 1), (3, 1), (37, 1), (70, 1), (64, 1), (17, 1), (5, 9)]
    for window in (None, 6):
        out, ref = run_case(3, 4, 4, 2, seqs, window)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
