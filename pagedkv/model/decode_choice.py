"""Which kernel runs a step's decode attention on the CPU, chosen by measurement: the fused
paged kernel (`paged_decode_attention`: the cache read in place, work shared out by sequence
and KV head, and a call of fewer such items than twice the threads, a lone decode's, also by
parts of the context, merged by log-sum-exp within the kernel) or torch's attention over the
gathered blocks (attention.decode_attention: a copy of each sequence's blocks, then batched
matmuls or SDPA; caches of the model's dtype only).

For each attention class (dtype, heads / KV heads, head size, block size, KV cache dtype) the
fused kernel and torch's are timed for each BATCHES x CONTEXTS bucket, at its representative
batch and context (the largest buckets at most MAX_TOKENS tokens in all), with
kernels/choice.py's one-thread CPU-time timing; the faster wins its bucket (the fused kernel
keeping it unless torch's is choice.KEEP_MARGIN faster), cached in the table file, section
"decode_attention".

PAGEDKV_KERNEL_CHOICE: "panel" and "isa" keep the fused kernel, "onednn" takes torch's (where
the cache is of the model's dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pagedkv.kernels import choice
from pagedkv.model.attention import _decode_group, gather_kv

# (first, last, measured at); the last is open-ended.
BATCHES: tuple[tuple[int, int, int], ...] = ((1, 1, 1), (2, 8, 8), (9, 9, 16))
CONTEXTS: tuple[tuple[int, int, int], ...] = ((1, 1024, 1024), (1025, 4096, 4096),
                                              (4097, 4097, 8192))
MAX_TOKENS = 32768  # batch x context of a measurement at most (the context shortened)
POOL_TOKENS = 4096  # the measurement cache: each sequence a shuffle of the same blocks
KERNELS = ("native", "torch")


class DecodeClass(NamedTuple):
    """An attention class: what a measured table holds for."""

    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: torch.dtype

    def key(self) -> str:
        """The table's key: "bfloat16 9/3x64 block 16 kv bfloat16"."""
        name = str(self.dtype).removeprefix("torch.")
        kv = str(self.kv_dtype).removeprefix("torch.")
        return f"{name} {self.heads}/{self.kv_heads}x{self.head_dim} block {self.block_size} " \
               f"kv {kv}"


class DecodeTable(NamedTuple):
    """One class's choice: `kernels[b][c]` the winner of batch bucket b and context bucket c."""

    kernels: tuple[tuple[str, ...], ...]

    def as_json(self) -> dict:
        return {"kernels": [list(row) for row in self.kernels]}


_tables: dict[str, DecodeTable] = {}  # class key -> measured table
_in_use: dict[DecodeClass, DecodeTable | str] = {}  # class -> table, or the forced kernel


def bucket(buckets: tuple[tuple[int, int, int], ...], n: int) -> int:
    """The index of the bucket holding n (the last one past its first)."""
    for i, (_, last, _) in enumerate(buckets[:-1]):
        if n <= last:
            return i
    return len(buckets) - 1


def bucket_label(buckets: tuple[tuple[int, int, int], ...], i: int) -> str:
    first, last, _ = buckets[i]
    return f"{first}+" if i == len(buckets) - 1 else (str(first) if first == last
                                                       else f"{first}-{last}")


def _measured_shape(b: int, c: int) -> tuple[int, int]:
    """(batch, context) a bucket is timed at: its representative batch, the context cut so
    that batch x context <= MAX_TOKENS."""
    batch, context = BATCHES[b][2], CONTEXTS[c][2]
    return batch, max(CONTEXTS[c][0], min(context, MAX_TOKENS // batch))


class _Inputs(NamedTuple):
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    tables: torch.Tensor
    first: torch.Tensor
    lens: torch.Tensor
    scale: float


def _inputs(cls: DecodeClass, batch: int, context: int, gen: torch.Generator) -> _Inputs:
    """Random q and a cache of POOL_TOKENS (at least `context`) tokens in the class's KV dtype;
    each sequence reads the pool's blocks in its own shuffled order."""
    bs = cls.block_size
    blocks = -(-max(context, POOL_TOKENS) // bs)
    shape = (cls.kv_heads, blocks, bs, cls.head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen) for _ in range(2))
    k_scales = v_scales = None
    if cls.kv_dtype == torch.int8:
        k_scales, v_scales = (c.abs().amax(-1) / 127 for c in (k_cache, v_cache))
        k_cache, v_cache = (torch.round(c / s.unsqueeze(-1)).to(torch.int8)
                            for c, s in ((k_cache, k_scales), (v_cache, v_scales)))
    else:
        k_cache, v_cache = k_cache.to(cls.kv_dtype), v_cache.to(cls.kv_dtype)
    per = -(-context // bs)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:per] for _ in range(batch)])
    q = torch.randn(batch, cls.heads, cls.head_dim, generator=gen).to(cls.dtype)
    return _Inputs(q, k_cache, v_cache, k_scales, v_scales, tables,
                   torch.zeros(batch, dtype=torch.long), torch.full((batch,), context),
                   cls.head_dim ** -0.5)


def decode_candidates(cls: DecodeClass, batch: int, context: int,
                      gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    """{"native": the fused kernel, "torch": gathered blocks and torch's attention (caches of
    the model's dtype only)}, each returning the attention [batch, heads, D] of the same
    random decodes."""
    x = _inputs(cls, batch, context, gen)
    out = torch.empty_like(x.q)
    ops = torch.ops.pagedkv_cpu

    def native() -> torch.Tensor:
        ops.paged_decode_attention_q(x.q, x.k_cache, x.v_cache, x.k_scales, x.v_scales,
                                     x.tables, x.first, x.lens, x.scale, out, None)
        return out

    calls: dict[str, Callable[[], torch.Tensor]] = {"native": native}
    if cls.kv_dtype == cls.dtype:
        def torch_own() -> torch.Tensor:
            k, v = (gather_kv(c, x.tables)[:, :, :context] for c in (x.k_cache, x.v_cache))
            return _decode_group(x.q, k, v, None, x.scale, False)[0]

        calls["torch"] = torch_own
    return calls


def measure_decode(cls: DecodeClass) -> DecodeTable:
    """Every bucket's winner of the fused kernel and torch's (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    kernels = []
    with choice.one_thread():
        for b in range(len(BATCHES)):
            row = []
            for c in range(len(CONTEXTS)):
                batch, context = _measured_shape(b, c)
                calls = decode_candidates(cls, batch, context, gen)
                row.append(choice.pick(choice.time_candidates(calls)))
            kernels.append(tuple(row))
    return DecodeTable(tuple(kernels))


def decode_table(cls: DecodeClass) -> DecodeTable | str:
    """The class's measured table, or the forced kernel's name, per PAGEDKV_KERNEL_CHOICE;
    measured once per class (and cached on disk)."""
    mode = choice.choice_mode()
    if mode != "measure":
        found: DecodeTable | str = "torch" if mode == "onednn" and cls.kv_dtype == cls.dtype \
            else "native"
    else:
        key = cls.key()
        if key not in _tables:
            entry = choice.cached_choice("decode_attention", key, _valid_entry,
                                         lambda: measure_decode(cls).as_json())
            _tables[key] = DecodeTable(tuple(map(tuple, entry["kernels"])))
        found = _tables[key]
    _in_use[cls] = found
    return found


def _valid_entry(entry: object) -> bool:
    """Whether a table file's entry has the buckets of this version."""
    if not isinstance(entry, dict):
        return False
    kernels = entry.get("kernels")
    return isinstance(kernels, list) and len(kernels) == len(BATCHES) and all(
        isinstance(row, list) and len(row) == len(CONTEXTS) and set(row) <= set(KERNELS)
        for row in kernels)


def decode_route(cls: DecodeClass, batch: int, longest: int) -> str:
    """"native" or "torch": the kernel for a step of `batch` decodes whose longest context is
    `longest` tokens."""
    return route_of(decode_table(cls), batch, longest)


def route_of(table: DecodeTable | str, batch: int, longest: int) -> str:
    """`decode_route` by a given table (or forced kernel)."""
    if isinstance(table, str):
        return table
    return table.kernels[bucket(BATCHES, batch)][bucket(CONTEXTS, longest)]


def describe_table(table: DecodeTable | str) -> str:
    """One class's choice in words: "native; torch at batch 9+, context 1-1024"."""
    if isinstance(table, str):
        return table
    parts = [f"{table.kernels[b][c]} at batch {bucket_label(BATCHES, b)}, "
             f"context {bucket_label(CONTEXTS, c)}"
             for b in range(len(BATCHES)) for c in range(len(CONTEXTS))
             if table.kernels[b][c] != "native"]
    return "native" + "".join(f"; {p}" for p in parts)


def decode_in_use() -> dict[str, dict]:
    """Every class this process ran decodes of on the CPU's fused kernels, measured or forced:
    {class key: {"forced": kernel}} or {class key: {"kernels": {batch bucket: {context bucket:
    kernel}}}}."""
    out: dict[str, dict] = {}
    for cls, table in sorted(_in_use.items(), key=lambda item: item[0].key()):
        if isinstance(table, str):
            out[cls.key()] = {"forced": table}
            continue
        out[cls.key()] = {"kernels": {
            bucket_label(BATCHES, b): {bucket_label(CONTEXTS, c): table.kernels[b][c]
                                       for c in range(len(CONTEXTS))}
            for b in range(len(BATCHES))}}
    return out


def describe_decode() -> str:
    """The decode attention's choice in words for a start-up banner."""
    mode = choice.choice_mode()
    if mode != "measure":
        kernel = 'torch' if mode == 'onednn' else 'native'
        return f"decode attention: {kernel} ({choice.ENV}={mode})"
    if not _in_use:
        return "decode attention: measured at the first decode"
    return "decode attention: " + "; ".join(
        f"{cls.key()}: {describe_table(table)}"
        for cls, table in sorted(_in_use.items(), key=lambda item: item[0].key()))


def runner_class(runner: object) -> DecodeClass | None:
    """The attention class of a model runner's decodes where they run this module's choice:
    the CPU's fused backend over a cache of the model's dtype, on one rank (None otherwise)."""
    backend = getattr(runner, "attn_backend", None)
    config = getattr(runner, "model_config", None)
    if getattr(backend, "name", "") != "cpu_native" or config is None \
            or getattr(runner, "tensor_parallel", None) is not None:
        return None
    dtype = runner.dtype  # type: ignore[attr-defined]
    return DecodeClass(dtype, config.num_heads, config.num_kv_heads, config.head_dim,
                       runner.block_size, dtype)  # type: ignore[attr-defined]
