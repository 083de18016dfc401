"""Paged attention against a dense reference on random inputs over many shapes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.model import attention
from pagedkv.model.attention import AttentionMetadata, PrefillChunk, paged_attention


def dense_reference(q, k, v, start_pos, window, scale, softcap=None):
    """q [n, H, D] at positions start_pos.., k/v [L, KVH, D] for positions 0..L-1; scores
    soft-capped (softcap * tanh(s / softcap)) when `softcap` is given."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(start_pos, start_pos + q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    mask = j <= pos
    if window is not None:
        mask &= j > pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(seed, block_size, num_heads, num_kv_heads, seqs, window, dtype=torch.float32,
             shares=None):
    """seqs: list of (cached_prefix_len, num_new_tokens). shares: {i: (j, n)}: sequence i's
    first n blocks are sequence j's (same physical blocks, same K/V; j < i, both cache them).
    Returns (paged, reference) outputs."""
    shares = shares or {}
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
        if i in shares:
            j, nb = shares[i]
            assert j < i and nb * block_size <= min(cached, seqs[j][0])
            tables[i][:nb] = tables[j][:nb]
            kf[: nb * block_size] = full_kv[j][0][: nb * block_size]
            vf[: nb * block_size] = full_kv[j][1][: nb * block_size]
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


def _shared_seqs(num_groups, per_group, prefix_blocks, block_size, gen, extra, new=(1,)):
    """Groups of `per_group` sequences sharing `prefix_blocks` leading blocks (the first member
    caches nothing more, the others a random number of own tokens) with `new[g % len(new)]` new
    tokens each in group g, then `extra` (cached, new) sequences sharing nothing.
    Returns (seqs, shares)."""
    seqs, shares = [], {}
    for gi in range(num_groups):
        leader = len(seqs)
        for m in range(per_group):
            own = int(torch.randint(0, 3 * block_size, (1,), generator=gen)) if m else 0
            seqs.append((prefix_blocks * block_size + own, new[gi % len(new)]))
            if m and prefix_blocks:
                shares[leader + m] = (leader, prefix_blocks)
    return seqs + extra, shares


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_blocks", [0, 1, 3, 9])
@pytest.mark.parametrize("group", [1, 4])
def test_shared_prefix_decodes_match_dense(monkeypatch, block_size, prefix_blocks, group):
    """Decodes sharing leading blocks (cascade attention), mixed with unrelated decodes and
    prefill chunks, equal the dense reference."""
    from pagedkv.model import cascade

    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 1)
    calls = []

    def counting(q, *args):
        calls.append(q.shape[0])
        return cascade.shared_prefix_attention(q, *args)

    monkeypatch.setattr(attention, "shared_prefix_attention", counting)
    gen = torch.Generator().manual_seed(block_size * 100 + prefix_blocks)
    extra = [(0, 1), (37, 1), (5, 9), (0, 12), (70, 1)]
    seqs, shares = _shared_seqs(2, 3, prefix_blocks, block_size, gen, extra)
    for window in (None, 7, 1000):
        calls.clear()
        out, ref = run_case(prefix_blocks, block_size, 2 * group, 2, seqs, window,
                            shares=shares)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        # Cascade: once per group of 3 decodes, unless the window hides part of the prefix.
        assert calls == ([] if prefix_blocks == 0 or window == 7 else [3, 3])


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_blocks", [1, 5])
@pytest.mark.parametrize("group", [1, 4])
def test_shared_prefix_prefills_match_dense(monkeypatch, block_size, prefix_blocks, group):
    """Prefill chunks sharing leading blocks (one group of chunks, one of decodes) attend to the
    prefix together and equal the dense reference, with and without a window."""
    from pagedkv.model import cascade

    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 1)
    calls = []

    def counting(q, *args):
        calls.append(q.shape[0])
        return cascade.shared_prefix_attention(q, *args)

    monkeypatch.setattr(attention, "shared_prefix_attention", counting)
    gen = torch.Generator().manual_seed(block_size * 7 + prefix_blocks)
    seqs, shares = _shared_seqs(2, 3, prefix_blocks, block_size, gen,
                                [(0, 5), (9, 1), (30, 6)], new=(6, 1))
    for window in (None, 3, 1000):
        calls.clear()
        out, ref = run_case(block_size, block_size, 2 * group, 2, seqs, window, shares=shares)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        # Decode group (3 rows) and prefill group (3 chunks of 6 tokens), unless windowed.
        assert sorted(calls) == ([] if window == 3 else [3, 18])


def test_shared_prefix_groups_found():
    """Groups: rows sharing a first block, prefix = identical leading columns, cut before each
    member's newest token; lone rows and short prefixes are left out."""
    from pagedkv.model.cascade import find_shared_prefixes

    tables = torch.tensor([[5, 6, 7, 8, 9],
                           [5, 6, 7, 3, 0],
                           [2, 4, 0, 0, 0],
                           [5, 6, 7, 8, 10],
                           [2, 4, 11, 0, 0],
                           [12, 13, 0, 0, 0]])
    lens = [17, 13, 5, 20, 9, 8]  # block size 4
    groups = find_shared_prefixes(tables, lens, 4, min_tokens=4)
    got = sorted((g.rows, g.num_blocks, g.block_ids.tolist()) for g in groups)
    # rows 0, 1, 3: columns 0-2 equal; row 1 (13 tokens) keeps block 3 (its newest token's).
    # rows 2, 4: row 2 has 5 tokens, so only block 0 is wholly before its newest token.
    assert got == [([0, 1, 3], 3, [5, 6, 7]), ([2, 4], 1, [2])]
    assert all(g.row_index.tolist() == g.rows for g in groups)
    # Rows 0, 1, 3 and 2, 4 are gathered by index; consecutive rows are a slice (views).
    assert all(torch.equal(g.index(), g.row_index) for g in groups)
    (pair,) = find_shared_prefixes(tables[:2], lens[:2], 4, min_tokens=4)
    assert pair.index() == slice(0, 2)
    assert [g.rows for g in find_shared_prefixes(tables, lens, 4, min_tokens=8)] == [[0, 1, 3]]
    assert find_shared_prefixes(tables[:1], lens[:1], 4, min_tokens=1) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shared_prefix_default_threshold(dtype):
    """The default threshold (MIN_SHARED_TOKENS) with a long shared prefix: cascade applies."""
    gen = torch.Generator().manual_seed(5)
    seqs, shares = _shared_seqs(1, 5, 6, 16, gen, [(40, 1), (3, 20)])
    calls = []
    real = attention.shared_prefix_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "shared_prefix_attention",
                   lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
        out, ref = run_case(11, 16, 8, 2, seqs, None, dtype=dtype, shares=shares)
    assert calls == [5]
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_prefill_chunks_batched_by_shape(monkeypatch, dtype):
    """Prefill chunks after a shared prefix attend to their own keys one batch per shape: four
    chunks of 5 new tokens right after the prefix, two of 3 new tokens after 6 cached own
    tokens, one of 7: three calls per layer, the dense reference's result."""
    from pagedkv.model import cascade

    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 1)
    calls = []
    real = attention._own_keys_attention
    monkeypatch.setattr(attention, "_own_keys_attention",
                        lambda q, kc, vc, batch, *a: calls.append(
                            (batch.tables.shape[0], batch.num_tokens, batch.num_keys))
                        or real(q, kc, vc, batch, *a))
    prefix, bs = 8, 4
    seqs = [(prefix, 5)] + [(prefix, 5)] * 3 + [(prefix + 6, 3)] * 2 + [(prefix, 7), (9, 1)]
    shares = {i: (0, prefix // bs) for i in range(1, 7)}
    out, ref = run_case(4, bs, 8, 2, seqs, None, dtype=dtype, shares=shares)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    assert sorted(calls) == [(1, 7, 7), (2, 3, 9), (4, 5, 5)]
