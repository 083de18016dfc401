"""Paged attention in pure torch (CPU and CUDA).

KV cache layout (one pair per layer, made in kv_cache.py): `k_cache`, `v_cache` are
[num_kv_heads, num_blocks, block_size, head_dim]; the token at position p of a request lives in
slot `block_table[p // block_size] * block_size + p % block_size`, i.e. column `slot` of the
[num_kv_heads, num_blocks * block_size, head_dim] view. Heads outermost means that gathering a
request's blocks (`index_select` on dim 1) yields one contiguous [context, head_dim] matrix per
head, which SDPA reads at full speed.

Speed (CPU): decodes are processed in groups whose gathered K/V fit in about `GATHER_BYTES`
(2 MiB): each group's blocks are copied (`index_select`) into a workspace reused across groups,
layers and steps, and attention then reads that copy from cache, so the K/V cross the memory bus
once. Sliding-window layers gather only the blocks inside the window. See
benchmarks/bench_attention.py for the cost against dense SDPA.

Shared prefixes (cascade attention, cascade.py): decodes whose block tables start with the same
physical blocks (prefix-cache hits) attend to those blocks once per group, all their queries
stacked per KV head, and to their own remaining blocks in the groups above; the two partial
results are merged exactly with their log-sum-exp. The groups are found once per step from the
decode block tables (`AttentionMetadata.shared_prefixes`) and used by every layer without a
sliding window narrower than the longest decode. Prefill chunks whose tables start with the
same cached blocks are grouped the same way (`prefill_shared_prefixes`,
`shared_prefill_attention`).

One `paged_attention` call per layer serves a mixed batch laid out as the runner builds it:
the decode tokens first (one per request, batched together), then the prefill chunks (each a
run of consecutive tokens of one request that attend causally to the request's cached prefix
and to themselves). A sliding window W lets the token at position p see positions p-W+1 .. p
(transformers' Mistral convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from pagedkv.model.cascade import (
    SharedPrefix,
    attention_with_lse,
    find_shared_prefixes,
    merge_states,
    shared_prefix_attention,
    window_hides_nothing,
)


@dataclass
class PrefillChunk:
    """Tokens [token_start, token_end) of the flattened batch: positions start_pos .. seq_len - 1
    of one request whose K/V for positions 0 .. seq_len - 1 sit in `block_table` [num_blocks]."""

    token_start: int
    token_end: int
    start_pos: int
    seq_len: int
    block_table: torch.Tensor


@dataclass
class OwnKeysBatch:
    """Prefill chunks of a shared-prefix group with the same shape after the prefix: `num_tokens`
    new tokens each, whose rows of the batch are `tokens` [b * num_tokens] (chunk by chunk), and
    `num_keys` keys after the prefix each (the new tokens last), in the blocks `tables` [b, W]."""

    tokens: torch.Tensor
    tables: torch.Tensor
    num_tokens: int
    num_keys: int


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer (built by the runner).

    `slot_mapping` [T]: cache slot of each token of the batch. The first `num_decodes` tokens
    are decodes of requests whose lengths (new token included) are `decode_seq_lens`
    [num_decodes] and whose block tables are the rows of `decode_block_tables`
    [num_decodes, max_blocks] (padded with the null block 0).
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    prefills: list[PrefillChunk]
    block_size: int
    decode_seq_lens_list: list[int] = field(default_factory=list)
    _mask_cache: dict = field(default_factory=dict, repr=False)
    # Scratch buffers by slot; pass the same dict every step to reuse them (one user at a time).
    workspace_buffers: dict = field(default_factory=dict, repr=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """`paged_attention` with this metadata (the backend seam every layer calls)."""
        return paged_attention(q, k, v, k_cache, v_cache, self, scale, window)

    def workspace(self, numel: int, dtype: torch.dtype, device: torch.device, slot: int) -> torch.Tensor:
        """A flat scratch tensor of `numel` elements (slot 0: K, 1: V); its contents are only
        valid until the next call with the same slot."""
        buf = self.workspace_buffers.get(slot)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.workspace_buffers[slot] = buf
        return buf[:numel]

    def shared_prefixes(self) -> list[SharedPrefix]:
        """Groups of decodes whose block tables start with the same blocks (cascade.py),
        computed once per step on first use and shared by every layer."""
        if "shared" not in self._mask_cache:
            lens = self.decode_seq_lens_list or self.decode_seq_lens.tolist()
            self._mask_cache["shared"] = find_shared_prefixes(
                self.decode_block_tables, lens, self.block_size)
        return self._mask_cache["shared"]

    def prefill_shared_prefixes(self) -> list[SharedPrefix]:
        """Groups of prefill chunks (rows index `prefills`) whose block tables start with the
        same blocks, all of them cached before each chunk's first new token; once per step."""
        if "prefill_shared" not in self._mask_cache:
            chunks, groups = self.prefills, []
            if len(chunks) >= 2:
                # Position start_pos is the chunk's first new token: blocks wholly before it.
                groups = find_shared_prefixes(self.prefill_block_tables(),
                                              [c.start_pos + 1 for c in chunks], self.block_size)
            self._mask_cache["prefill_shared"] = groups
        return self._mask_cache["prefill_shared"]

    def prefill_block_tables(self) -> torch.Tensor:
        """The prefill chunks' block tables stacked [len(prefills), widest] (long, rows padded
        with the null block 0); once per step."""
        if "prefill_tables" not in self._mask_cache:
            chunks = self.prefills
            width = max((len(c.block_table) for c in chunks), default=0)
            dev = chunks[0].block_table.device if chunks else self.slot_mapping.device
            tables = torch.zeros(len(chunks), width, dtype=torch.long, device=dev)
            for r, c in enumerate(chunks):
                tables[r, : len(c.block_table)] = c.block_table
            self._mask_cache["prefill_tables"] = tables
        return self._mask_cache["prefill_tables"]

    def own_keys_batches(self, group: SharedPrefix) -> tuple[list[OwnKeysBatch], torch.Tensor]:
        """(the prefill chunks of `group` in batches of one shape after the shared prefix, the
        rows of the batch of all their tokens in batch order [sum of b * num_tokens]); once per
        step per group."""
        key = ("own", tuple(group.rows))
        if key not in self._mask_cache:
            bs, first = self.block_size, group.num_blocks
            shapes: dict[tuple[int, int], list[PrefillChunk]] = {}
            for r in group.rows:
                c = self.prefills[r]
                shape = (c.token_end - c.token_start, c.seq_len - first * bs)
                shapes.setdefault(shape, []).append(c)
            dev = self.slot_mapping.device
            batches = []
            for (n, keys), chunks in shapes.items():
                width = -(-keys // bs)
                tokens = torch.cat([torch.arange(c.token_start, c.token_end, device=dev)
                                    for c in chunks])
                tables = torch.stack([c.block_table[first:first + width] for c in chunks])
                batches.append(OwnKeysBatch(tokens, tables.to(dev), n, keys))
            self._mask_cache[key] = (batches, torch.cat([b.tokens for b in batches]))
        return self._mask_cache[key]

    def own_keys_bias(self, num_tokens: int, num_keys: int, width: int, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [num_tokens * group, width] (0 / -inf) of an `OwnKeysBatch`'s causal
        attention, `group` query heads per KV head folded into the rows (row t * group + i is
        token t): token t sees keys 0 .. num_keys - num_tokens + t; once per step per shape."""
        key = ("own_bias", num_tokens, num_keys, width, group, dtype)
        if key not in self._mask_cache:
            dev = self.slot_mapping.device
            last = torch.arange(num_tokens, device=dev).repeat_interleave(group) + (
                num_keys - num_tokens)
            hidden = torch.arange(width, device=dev)[None, :] > last[:, None]
            self._mask_cache[key] = torch.zeros(hidden.shape, dtype=dtype, device=dev
                                                ).masked_fill_(hidden, float("-inf"))
        return self._mask_cache[key]

    def decode_view(self, window: int | None) -> tuple[torch.Tensor, list[int], list[int]]:
        """(block tables [num_decodes, width], first key position of each row, number of
        blocks each row needs) for the decode requests. With a window only the blocks that
        hold the last `window` positions are listed, so long requests gather little; without
        one, the rows of a shared-prefix group list only the blocks after their shared prefix
        (attended once for the whole group, see `shared_prefixes`)."""
        key = ("view", window)
        if key not in self._mask_cache:
            bs, tables = self.block_size, self.decode_block_tables
            lens = self.decode_seq_lens_list or self.decode_seq_lens.tolist()
            if window is None:
                first = [0] * len(lens)
                for group in self.shared_prefixes():
                    for r in group.rows:
                        first[r] = group.num_blocks
            else:
                first = [max(0, n - window) // bs for n in lens]
            needed = [-(-n // bs) - f for n, f in zip(lens, first, strict=True)]
            if any(first) and tables.shape[1]:
                width = max(needed)
                idx = torch.tensor(first, device=tables.device)[:, None] + torch.arange(
                    width, device=tables.device)[None, :]
                tables = tables.gather(1, idx.clamp(max=tables.shape[1] - 1))
            self._mask_cache[key] = (tables, [f * bs for f in first], needed)
        return self._mask_cache[key]

    def decode_mask(self, window: int | None, start: int, end: int, num_keys: int) -> torch.Tensor:
        """[end - start, num_keys] bool: which gathered keys decode rows start..end-1 see."""
        key = ("mask", window, start, end, num_keys)
        if key not in self._mask_cache:
            _, key_start, _ = self.decode_view(window)
            dev = self.decode_seq_lens.device
            pos = torch.arange(num_keys, device=dev)[None, :] + torch.tensor(
                key_start[start:end], device=dev)[:, None]
            lens = self.decode_seq_lens[start:end, None]
            mask = pos < lens
            if window is not None:
                mask &= pos > lens - 1 - window
            self._mask_cache[key] = mask
        return self._mask_cache[key]

    def decode_bias(self, window: int | None, start: int, end: int, num_keys: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """`decode_mask` as an additive [end - start, num_keys] mask in `dtype` (0 / -inf)."""
        key = ("bias", window, start, end, num_keys, dtype)
        if key not in self._mask_cache:
            mask = self.decode_mask(window, start, end, num_keys)
            self._mask_cache[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device
                                                ).masked_fill_(~mask, float("-inf"))
        return self._mask_cache[key]


GATHER_BYTES = 2 << 20


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] into their slots of k_cache / v_cache (mutated)."""
    h, nb, bs, d = k_cache.shape
    k_cache.view(h, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(h, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """[S, kv_heads, max_blocks * block_size, head_dim] copy of the blocks in `block_tables`
    [S, max_blocks], written into `out` (flat, S * max_blocks * block numel) when given."""
    s, mb = block_tables.shape
    h, _, bs, d = cache.shape
    flat = block_tables.reshape(-1)
    if out is None:
        g = cache.index_select(1, flat)
    else:
        g = torch.index_select(cache, 1, flat, out=out.view(h, s * mb, bs, d))
    return g.view(h, s, mb * bs, d).transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, causal: bool = False) -> torch.Tensor:
    if q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  scale=scale, enable_gqa=True)
        except (RuntimeError, TypeError):
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Attention output [T, heads, head_dim] for q [T, heads, head_dim].

    k, v [T, kv_heads, head_dim] are the batch's new keys/values: they are written into the
    cache first (mutating k_cache / v_cache), then every token attends through its block table.
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = decode_attention(q[:nd], k_cache, v_cache, meta, scale, window)
    prefill_attention_all(q, k, v, k_cache, v_cache, meta, scale, window, out)
    return out


def prefill_attention_all(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, window: int | None, out: torch.Tensor) -> None:
    """Every prefill chunk's attention (their K/V already in the cache), written into their
    rows of `out` [T, heads, head_dim]; chunks sharing cached prefix blocks as cascades."""
    done: set[int] = set()
    if meta.prefills and (window is None or window >= max(c.seq_len for c in meta.prefills)):
        for group in meta.prefill_shared_prefixes():
            shared_prefill_attention(q, k, v, k_cache, v_cache, meta, group, scale, out)
            done.update(group.rows)
    for idx, chunk in enumerate(meta.prefills):
        if idx not in done:
            s, e = chunk.token_start, chunk.token_end
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, chunk, scale,
                                         window)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """One query token per request, q [S, heads, head_dim]; requests in cache-sized groups.

    Without a sliding window (or with one wider than every request), requests sharing leading
    blocks attend to them once per group (cascade.py) and to their own blocks here; the two
    partial results are merged exactly.
    """
    h, _, bs, d = k_cache.shape
    lens = meta.decode_seq_lens_list or meta.decode_seq_lens.tolist()
    if window_hides_nothing(window, lens):
        window = None
    shared = meta.shared_prefixes() if window is None else []
    all_tables, key_start, needed = meta.decode_view(window)
    block_bytes = 2 * h * bs * d * k_cache.element_size()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if shared else None
    in_shared = [False] * len(lens)
    for group in shared:
        for r in group.rows:
            in_shared[r] = True
    i, n = 0, len(lens)
    while i < n:
        width, j = needed[i], i + 1
        while j < n and (j + 1 - i) * max(width, needed[j]) * block_bytes <= GATHER_BYTES:
            width = max(width, needed[j])
            j += 1
        tables = all_tables[i:j, :width]
        numel = (j - i) * width * bs * h * d
        kg = gather_kv(k_cache, tables, meta.workspace(numel, k_cache.dtype, k_cache.device, 0))
        vg = gather_kv(v_cache, tables, meta.workspace(numel, v_cache.dtype, v_cache.device, 1))
        full = window is None and all(lens[r] - key_start[r] == width * bs for r in range(i, j))
        bias = None if full else meta.decode_bias(window, i, j, width * bs, q.dtype)
        want_lse = any(in_shared[i:j])
        o, group_lse = _decode_group(q[i:j], kg, vg, bias, scale, want_lse)
        out[i:j] = o
        if want_lse:
            lse[i:j] = group_lse
        i = j
    for group in shared:
        rows = group.index()
        o_p, lse_p = shared_prefix_attention(q[rows], k_cache, v_cache, group, scale)
        out[rows] = merge_states(out[rows], lse[rows], o_p, lse_p)
    return out


def _decode_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  bias: torch.Tensor | None, scale: float, want_lse: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [S, heads, D], log-sum-exp [S, heads] float32 of each row's scaled scores, or None
    unless `want_lse`) of q [S, heads, D] over k, v [S, kv_heads, L, D] (views of a
    [kv_heads, S, L, D] buffer) with an additive mask `bias` [S, L] (0 visible, -inf hidden).

    float32: two batched matmuls (all heads of a KV group in one [group, D] x [D, L] product)
    and a softmax, measured ~15% faster than CPU SDPA on these shapes; bfloat16 / float16:
    SDPA, which reads the strided views directly and accumulates in float32 (with `want_lse`,
    the flash kernel it runs, the heads of a KV group folded into its query rows).
    """
    s, heads, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    g = heads // kvh
    if q.dtype != torch.float32:
        b = None if bias is None else bias[:, None, None, :]
        if want_lse:
            out, lse = attention_with_lse(q.view(s, kvh, g, d), k, v, b, scale)
            return out.reshape(s, heads, d), lse.reshape(s, heads)
        return _sdpa(q.unsqueeze(2), k, v, b, scale).squeeze(2), None
    kb = k.transpose(0, 1).reshape(kvh * s, length, d)  # views: the buffer is [kvh, S, L, D]
    vb = v.transpose(0, 1).reshape(kvh * s, length, d)
    qb = q.reshape(s, kvh, g, d).transpose(0, 1).reshape(kvh * s, g, d)
    scores = torch.bmm(qb, kb.transpose(1, 2)).mul_(scale)  # [kvh * S, g, L]
    if bias is not None:
        scores.view(kvh, s, g, length).add_(bias[None, :, None, :])
    lse = None
    if want_lse:
        lse = torch.logsumexp(scores, -1)
        probs = scores.sub_(lse.unsqueeze(-1)).exp_()
        lse = lse.view(kvh, s, g).transpose(0, 1).reshape(s, heads)
    else:
        probs = torch.softmax(scores, -1)
    out = torch.bmm(probs, vb)  # [kvh * S, g, D]
    return out.view(kvh, s, g, d).transpose(0, 1).reshape(s, heads, d), lse


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                      window: int | None) -> torch.Tensor:
    """Causal attention of one prefill chunk, q [n, heads, head_dim], over prefix + itself."""
    n = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)
    if chunk.start_pos == 0 and (window is None or window >= n):
        kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        return _sdpa(qh, kh, vh, None, scale, causal=True)[0].transpose(0, 1)
    bs = k_cache.shape[2]
    num_blocks = (chunk.seq_len + bs - 1) // bs
    # With a window, blocks wholly before the first visible position are skipped.
    first = 0 if window is None else max(0, chunk.start_pos - window + 1) // bs
    table = chunk.block_table[first:num_blocks].unsqueeze(0)
    kg, vg = gather_kv(k_cache, table), gather_kv(v_cache, table)
    pos = torch.arange(chunk.start_pos, chunk.seq_len, device=q.device)[:, None]
    j = torch.arange(kg.shape[2], device=q.device)[None, :] + first * bs
    mask = j <= pos
    if window is not None:
        mask &= j > pos - window
    return _sdpa(qh, kg, vg, mask, scale)[0].transpose(0, 1)


def shared_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, group: SharedPrefix, scale: float,
                             out: torch.Tensor) -> None:
    """Cascade attention for the prefill chunks `group.rows` of `meta.prefills` (no window):
    all their queries over the shared prefix blocks in one call, the chunks over their own
    remaining keys a batch of equally shaped chunks per call (`OwnKeysBatch`), merged; writes
    the chunks' rows of `out` [T, heads, D]. k, v are already in the cache."""
    batches, tokens = meta.own_keys_batches(group)
    o_p, lse_p = shared_prefix_attention(q.index_select(0, tokens), k_cache, v_cache, group,
                                         scale)
    parts = [_own_keys_attention(q, k_cache, v_cache, b, meta, scale) for b in batches]
    o = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
    lse = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
    out.index_copy_(0, tokens, merge_states(o, lse, o_p, lse_p))


def _own_keys_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: OwnKeysBatch, meta: AttentionMetadata, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b * n, heads, D], lse [b * n, heads] float32) of the batch's chunks' causal
    attention over their keys after the shared prefix, rows in `batch.tokens` order: one call,
    the query heads of each KV head folded into its rows (no copy of K/V per query head)."""
    heads, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[0]
    g, b, n = heads // kvh, batch.tables.shape[0], batch.num_tokens
    kg, vg = gather_kv(k_cache, batch.tables), gather_kv(v_cache, batch.tables)
    qb = q.index_select(0, batch.tokens).view(b, n, kvh, g, d).permute(0, 2, 1, 3, 4)
    bias = meta.own_keys_bias(n, batch.num_keys, kg.shape[2], g, q.dtype)
    o, lse = attention_with_lse(qb.reshape(b, kvh, n * g, d), kg, vg, bias, scale)
    o = o.view(b, kvh, n, g, d).permute(0, 2, 1, 3, 4).reshape(b * n, heads, d)
    return o, lse.view(b, kvh, n, g).permute(0, 2, 1, 3).reshape(b * n, heads)
