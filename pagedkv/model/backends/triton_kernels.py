"""Triton kernels of the CUDA attention backend: one launch stores the step's K/V into their
slots, one launch attends every token of the step (decodes and prefill chunks alike) through the
block tables, reading K/V in place.

Cache layout (kv_cache.py): k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim],
contiguous per head, so the token in slot s of KV head h is row `h * stride_h + s * head_dim`.

The attention kernel follows the idea of vLLM's `triton_unified_attention` (written anew here):
the batch is a list of sequences, sequence i owning the query tokens
query_start_loc[i] .. query_start_loc[i + 1] - 1, which are the last q_len of its seq_len
positions. One program handles BLOCK_Q consecutive query tokens of one sequence for one KV head,
all the NUM_QUERIES_PER_KV query heads of that KV head stacked into its BLOCK_M rows (GQA: the
K/V tile is loaded once for the whole group). It walks the sequence's keys in tiles of TILE_N
positions, each key's block looked up in the block table, with an online softmax in float32.
Token at position p sees keys p - window + 1 .. p (causal; `window` is huge without a sliding
window). The grid has a fixed size for a given (num_tokens, num_seqs), so a decode batch of a
fixed size can be captured in a CUDA graph; programs past the end of their sequence exit.

The kernels also run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how
CI tests their logic without a GPU (tests/model/test_triton_attention.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_cache_h,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    KV_HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Program t copies token t's keys and values (every KV head) into slot slot_mapping[t];
    a negative slot (a padding token) is skipped."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src_k = t.to(tl.int64) * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :]
    src_v = t.to(tl.int64) * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :]
    dst = offs_h[:, None].to(tl.int64) * stride_cache_h + slot * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + src_k, mask=mask)
    v = tl.load(v_ptr + src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include global query block `q_block` (binary search;
    sequence i's blocks start at query_start_loc[i] // BLOCK_Q + i)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Triton compiles a variant per "== 1" / "multiple of 16" value of an integer argument; these
# change from step to step (batch size, block-table width), so they are not specialised on:
# one compiled kernel per tile shape, none in the middle of a run.
@triton.jit(do_not_specialize=["num_seqs", "window", "stride_bt"])
def paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, scale, num_seqs, window, softcap,
        stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_cache_h, stride_bt,
        k_scale_ptr, v_scale_ptr, stride_scale_h,
        NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SCALES: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr):
    """HAS_SCALES (int8 caches, kv_int8.py): k_scale_ptr / v_scale_ptr are the per-slot scales
    [num_kv_heads, num_blocks * block_size] (float32); a key's scale multiplies its scores and a
    value's its softmax weights (the int8 values themselves are exact in q's dtype).
    HAS_SOFTCAP (Gemma 2): each score s becomes softcap * tanh(s / softcap) before masking."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    token = local_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # within the sequence's queries
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m // NUM_QUERIES_PER_KV < BLOCK_Q) & (token < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = context_len + token  # each row's position in its sequence
    rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    first_pos = context_len + local_block * BLOCK_Q
    key_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # keys past the block's last query: hidden
    key_start = tl.maximum(first_pos - window + 1, 0) // TILE_N * TILE_N
    cache_head = kv_head.to(tl.int64) * stride_cache_h
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(key_start, key_end, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_ok = offs_n < key_end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        kv_off = cache_head + slot[:, None] * HEAD_DIM + offs_d[None, :]
        # An fp8 cache is read in place and converted here (no-op for a model-dtype cache).
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if HAS_SCALES:
            scale_off = kv_head.to(tl.int64) * stride_scale_h + slot
            s = s * tl.load(k_scale_ptr + scale_off, mask=n_ok, other=0.0)[None, :]
            v_weight = tl.load(v_scale_ptr + scale_off, mask=n_ok, other=0.0)
        if HAS_SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1, no libdevice
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
                   & (offs_n[None, :] > q_pos[:, None] - window))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = p
        if HAS_SCALES:
            pv = p * v_weight[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
