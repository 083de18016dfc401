"""Which kernel runs a step's decode attention on the CPU, chosen by measurement: the fused
paged kernel (`paged_decode_attention`: the cache read in place, work shared out by sequence
and KV head), torch's attention over the gathered blocks (attention.decode_attention: a copy
of each sequence's blocks, then batched matmuls or SDPA; caches of the model's dtype only), or
the fused kernel split over the context ("split2", "split4": decode_split.py, one sequence's
context in 2 or 4 runs merged by log-sum-exp).

For each attention class (dtype, heads / KV heads, head size, block size, KV cache dtype) the
fused kernel and torch's are timed for each BATCHES x CONTEXTS bucket, at its representative
batch and context (the largest buckets at most MAX_TOKENS tokens in all), with
kernels/choice.py's one-thread CPU-time timing; the faster wins its bucket (the fused kernel
keeping it unless torch's is choice.KEEP_MARGIN faster). The split's worth depends on the
threads, which one-thread timing cannot see, and timing several threads' wall clock on a shared
machine measures the other processes; so at batch 1 the split's own one-thread cost is measured
(its time over the fused kernel's, for each context bucket) and the split runs where that cost
is repaid by the threads' balance: the fused kernel's S x KV heads items take
ceil(items / threads) rounds, the split's `parts` times as many items fewer per thread
(`split_parts`), from SPLIT_FROM keys and by SPLIT_MARGIN. All of it is cached in the table
file, section "decode_attention".

PAGEDKV_KERNEL_CHOICE: "panel" and "isa" keep the fused kernel, "onednn" takes torch's (where
the cache is of the model's dtype); neither splits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from pagedkv.kernels import choice
from pagedkv.model.attention import _decode_group, gather_kv
from pagedkv.model.decode_split import split_decode, split_rows

# (first, last, measured at); the last is open-ended.
BATCHES: tuple[tuple[int, int, int], ...] = ((1, 1, 1), (2, 8, 8), (9, 9, 16))
CONTEXTS: tuple[tuple[int, int, int], ...] = ((1, 1024, 1024), (1025, 4096, 4096),
                                              (4097, 4097, 8192))
SPLITS = (2, 4)
SPLIT_FROM = CONTEXTS[1][0]  # the shortest context split: below, a parallel region's and the
# merge's fixed costs, which one-thread timing does not see, were measured to outweigh it
SPLIT_MARGIN = 1.25  # the split's predicted gain it must show (it pays those costs too)
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
    """One class's choice: `kernels[b][c]` the winner of batch bucket b and context bucket c,
    `split_cost[c][i]` the one-thread time of SPLITS[i] runs over the fused kernel's at
    batch 1, context bucket c (None: not measured, never split)."""

    kernels: tuple[tuple[str, ...], ...]
    split_cost: tuple[tuple[float, ...], ...] | None

    def as_json(self) -> dict:
        return {"kernels": [list(row) for row in self.kernels],
                "split_cost": None if self.split_cost is None
                else [[round(c, 3) for c in row] for row in self.split_cost]}


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


def decode_candidates(cls: DecodeClass, batch: int, context: int, gen: torch.Generator,
                      splits: tuple[int, ...] = ()) -> dict[str, Callable[[], torch.Tensor]]:
    """{"native": the fused kernel, "torch": gathered blocks and torch's attention (caches of
    the model's dtype only), "split<P>" for each of `splits` (batch 1 only)}, each returning
    the attention [batch, heads, D] of the same random decodes."""
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
    for parts in splits:
        rows = split_rows(x.tables[0], 0, context, cls.block_size, parts)
        split_out = torch.empty_like(x.q)
        calls[f"split{parts}"] = (lambda rows=rows, o=split_out: split_decode(
            x.q, x.k_cache, x.v_cache, rows, x.scale, o, x.k_scales, x.v_scales))
    return calls


def measure_decode(cls: DecodeClass) -> DecodeTable:
    """Every bucket's winner of the fused kernel and torch's, and the split's one-thread cost
    at batch 1 per context bucket (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    kernels, costs = [], []
    with choice.one_thread():
        for b in range(len(BATCHES)):
            row = []
            for c in range(len(CONTEXTS)):
                batch, context = _measured_shape(b, c)
                calls = decode_candidates(cls, batch, context, gen, SPLITS if batch == 1 else ())
                row.append(choice.pick(choice.time_candidates(
                    {k: calls[k] for k in KERNELS if k in calls})))
                if batch == 1:  # apart from torch's, whose copies would evict the cache
                    times = choice.time_candidates(
                        {k: f for k, f in calls.items() if k != "torch"})
                    costs.append(tuple(times[f"split{p}"] / times["native"] for p in SPLITS))
            kernels.append(tuple(row))
    return DecodeTable(tuple(kernels), tuple(costs))


def split_parts(costs: tuple[float, ...], kv_heads: int, threads: int) -> int:
    """The runs (1: no split) one sequence's decode is cut into on `threads` threads: each
    of SPLITS at its measured one-thread cost `costs` against the fused kernel's balance
    (kv_heads items: ceil(kv_heads / threads) rounds of 1 / kv_heads of the work; P runs:
    ceil(P kv_heads / threads) rounds of cost / (P kv_heads)), the best where it is
    SPLIT_MARGIN faster."""
    native = math.ceil(kv_heads / threads) / kv_heads
    best, best_time = 1, native
    for parts, cost in zip(SPLITS, costs, strict=True):
        items = parts * kv_heads
        predicted = cost * math.ceil(items / threads) / items
        if predicted * SPLIT_MARGIN < native and predicted < best_time:
            best, best_time = parts, predicted
    return best


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
            costs = entry["split_cost"]
            _tables[key] = DecodeTable(tuple(map(tuple, entry["kernels"])),
                                       None if costs is None else tuple(map(tuple, costs)))
        found = _tables[key]
    _in_use[cls] = found
    return found


def _valid_entry(entry: object) -> bool:
    """Whether a table file's entry has the buckets of this version."""
    if not isinstance(entry, dict):
        return False
    kernels, costs = entry.get("kernels"), entry.get("split_cost")
    shape_ok = isinstance(kernels, list) and len(kernels) == len(BATCHES) and all(
        isinstance(row, list) and len(row) == len(CONTEXTS) and set(row) <= set(KERNELS)
        for row in kernels)
    costs_ok = costs is None or (isinstance(costs, list) and len(costs) == len(CONTEXTS) and all(
        isinstance(row, list) and len(row) == len(SPLITS) for row in costs))
    return shape_ok and costs_ok


def decode_route(cls: DecodeClass, batch: int, longest: int, threads: int) -> str:
    """"native", "torch" or "split<P>": the kernel for a step of `batch` decodes whose longest
    context is `longest` tokens, on `threads` threads."""
    return route_of(decode_table(cls), cls, batch, longest, threads)


def route_of(table: DecodeTable | str, cls: DecodeClass, batch: int, longest: int,
             threads: int) -> str:
    """`decode_route` by a given table (or forced kernel)."""
    if isinstance(table, str):
        return table
    c = bucket(CONTEXTS, longest)
    kernel = table.kernels[bucket(BATCHES, batch)][c]
    if kernel != "native" or batch != 1 or table.split_cost is None or threads < 2:
        return kernel
    parts = split_parts(table.split_cost[c], cls.kv_heads, threads)
    if parts == 1 or longest < max(SPLIT_FROM, 2 * parts * cls.block_size):
        return kernel
    return f"split{parts}"


def describe_table(cls: DecodeClass, table: DecodeTable | str, threads: int) -> str:
    """One class's choice in words: "native; split4 at batch 1 from 513 tokens (2 threads)"."""
    if isinstance(table, str):
        return table
    parts = []
    for b in range(len(BATCHES)):
        for c in range(len(CONTEXTS)):
            if table.kernels[b][c] != "native":
                parts.append(f"{table.kernels[b][c]} at batch {bucket_label(BATCHES, b)}, "
                             f"context {bucket_label(CONTEXTS, c)}")
    if table.split_cost is not None:
        for c in range(bucket(CONTEXTS, SPLIT_FROM), len(CONTEXTS)):
            n = split_parts(table.split_cost[c], cls.kv_heads, threads)
            if n > 1 and table.kernels[0][c] == "native":
                parts.append(f"split{n} at batch 1, context {bucket_label(CONTEXTS, c)} "
                             f"({threads} threads)")
    return "native" + "".join(f"; {p}" for p in parts)


def decode_in_use() -> dict[str, dict]:
    """Every class this process ran decodes of on the CPU's fused kernels, measured or forced:
    {class key: {"forced": kernel}} or {class key: {"kernels": {batch bucket: {context bucket:
    kernel}}, "split_cost": [[cost of each of SPLITS] per context bucket], "threads": torch's
    threads now, "batch_1": {context bucket: the kernel a lone decode takes now}}}."""
    threads = torch.get_num_threads()
    out: dict[str, dict] = {}
    for cls, table in sorted(_in_use.items(), key=lambda item: item[0].key()):
        if isinstance(table, str):
            out[cls.key()] = {"forced": table}
            continue
        kernels = {bucket_label(BATCHES, b): {bucket_label(CONTEXTS, c): table.kernels[b][c]
                                              for c in range(len(CONTEXTS))}
                   for b in range(len(BATCHES))}
        lone = {bucket_label(CONTEXTS, c): route_of(table, cls, 1, CONTEXTS[c][2], threads)
                for c in range(len(CONTEXTS))}
        out[cls.key()] = {"kernels": kernels, "split_cost": table.as_json()["split_cost"],
                          "threads": threads, "batch_1": lone}
    return out


def describe_decode() -> str:
    """The decode attention's choice in words for a start-up banner."""
    mode = choice.choice_mode()
    if mode != "measure":
        kernel = 'torch' if mode == 'onednn' else 'native'
        return f"decode attention: {kernel} ({choice.ENV}={mode})"
    if not _in_use:
        return "decode attention: measured at the first decode"
    threads = torch.get_num_threads()
    return "decode attention: " + "; ".join(
        f"{cls.key()}: {describe_table(cls, table, threads)}"
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
