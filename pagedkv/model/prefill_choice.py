"""Which kernel runs a step's prefill attention on the CPU, chosen by measurement: the fused
tiled kernel (`paged_prefill_attention`, vdpbf16ps / AVX-512 dot products, reading the paged
cache in place) or torch's own attention on the chunks' K/V (attention.prefill_attention_all:
scaled_dot_product_attention, whose flash kernel multiplies bfloat16 with oneDNN's brgemm,
on AMX tiles where the CPU has them, for chunks from 64 query tokens, fresh or after a cached
prefix; tests/model/test_prefill_amx.py checks it).

On an Intel CPU with AMX, torch's was measured faster in bfloat16 from about 64 query tokens
of a fresh prompt (2x at 256, 3x at 2,048) and from about 32 after a cached prefix of 1,024
(a prefix-cache hit: torch's gathers the prefix's blocks and runs the same flash kernel with
a mask, 2x at 128), the fused kernel faster below; elsewhere the fused kernel may win
throughout. So for each attention class (dtype, heads / KV heads, head size, block size) a
chunk of each of LENGTHS query tokens is timed both ways, once fresh (from position 0) and once
after a cached prefix of PREFIX tokens (kernels/choice.py's one-thread CPU-time timing, cached
in its table file): each kind runs torch's from the first length at which torch's wins at that
length and every longer one. A step's prefill runs torch's when one of its chunks is at least
its kind's length (the longest chunk decides, as one call of either kernel takes them all).
PAGEDKV_KERNEL_CHOICE: "panel" and "isa" keep the fused kernel, "onednn" takes torch's always.

Fresh prompts in bfloat16 on a CPU with AMX tiles have a third kernel, `amx_prefill_attention`
(kernels/csrc/prefill_attention_amx.cpp: both products on AMX tiles, reading the step's K/V):
with the default choice mode a step's fresh prompts (from position
0, no window hiding any of their keys) runs it for them (the step's other chunks as above),
since it beat both others at every length measured on an Intel Xeon with AMX (16 to 1,536
tokens; 1.4-1.7x torch's from 256 tokens).
`amx_fresh` in a class's entry says it is in use.

Shared prefixes (cascade attention, cascade.py) have a fourth, `amx_prefix_attention` (the same
file): every query of a group over the prefix's cache blocks, re-laid for the tiles once per KV
head. With the default choice mode, bfloat16, a CPU with AMX tiles and a block size that is a
multiple of 16, a step's decodes run their shared prefix part on it (`amx_prefix` in a class's
entry): 32 decodes over a shared 1,024-token prefix (the random Llama's 8/4x64 heads, block 32)
took 0.33 ms a layer on it against 0.80 ms on the fused kernel, one thread of an Intel Xeon.
So do a step's prefill chunks that share a cached prefix (cpu_native.PrefillCascade, whatever
the lengths above say): 31 chunks of 32 tokens after a shared 1,024-token prefix took 10 ms a
layer (own keys on the fused decode kernel, the prefix on AMX tiles, merged in the kernel)
against 15-18 ms for torch's cascade (flash attention for the prefix, merge_states), one thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pagedkv.kernels import choice
from pagedkv.model.attention import PrefillChunk, prefill_attention

LENGTHS = (16, 32, 64, 128, 256, 512)
PREFIX = 1024  # cached tokens before the chunk measured "after a prefix"


class TorchFrom(NamedTuple):
    """The first chunk length at which a step's prefill runs torch's attention (0: always;
    None: never), for a fresh chunk (from position 0) and for one after a cached prefix."""

    fresh: int | None
    after_prefix: int | None
    amx_fresh: bool = False  # steps of fresh prompts only run the AMX kernel
    amx_prefix: bool = False  # decodes' shared prefixes run amx_prefix_attention

    def lengths_json(self) -> dict[str, int | None]:
        """The measured lengths (the table file's entry)."""
        return {"torch_from": self.fresh, "torch_from_after_prefix": self.after_prefix}

    def as_json(self) -> dict[str, int | None | bool]:
        return {**self.lengths_json(), "amx_fresh": self.amx_fresh,
                "amx_prefix": self.amx_prefix}


_torch_from: dict[str, TorchFrom] = {}  # attention class -> first lengths for torch's
# (dtype, heads, KV heads, head size, block size) -> the lengths in use, measured or forced
_in_use: dict[tuple[torch.dtype, int, int, int, int], TorchFrom] = {}


def attention_class(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                    block_size: int) -> str:
    """The table's key: "bfloat16 8/4x64 block 16"."""
    return f"{str(dtype).removeprefix('torch.')} {heads}/{kv_heads}x{head_dim} block {block_size}"


def prefill_candidates(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       block_size: int, n: int, gen: torch.Generator, cached: int = 0
                       ) -> dict[str, Callable[[], torch.Tensor]]:
    """{"native": the fused kernel's call, "torch": torch's}, each returning the attention
    [n, heads, D] of one chunk of `n` random query tokens after `cached` tokens of a cached
    prefix (causal; its K/V and the prefix's in a paged cache)."""
    length = cached + n
    blocks = -(-length // block_size)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    k_all, v_all = (torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype)
                    for _ in range(2))
    k_cache, v_cache = (torch.zeros(kv_heads, blocks * block_size, head_dim, dtype=dtype)
                        for _ in range(2))
    k_cache[:, :length], v_cache[:, :length] = k_all.transpose(0, 1), v_all.transpose(0, 1)
    k_cache, v_cache = (c.view(kv_heads, blocks, block_size, head_dim) for c in (k_cache, v_cache))
    k, v = k_all[cached:], v_all[cached:]
    table = torch.arange(blocks)
    rows = (torch.tensor([0]), torch.tensor([n]), torch.tensor([length]))
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    chunk = PrefillChunk(0, n, cached, length, table)

    def native() -> torch.Tensor:
        torch.ops.pagedkv_cpu.paged_prefill_attention(q, k_cache, v_cache, table.view(1, -1),
                                                      *rows, 0, scale, out)
        return out

    def torch_own() -> torch.Tensor:
        return prefill_attention(q, k, v, k_cache, v_cache, chunk, scale, None)

    return {"native": native, "torch": torch_own}


def measure_prefill(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                    block_size: int) -> TorchFrom:
    """The first of LENGTHS from which torch's attention beats the fused kernel at every
    longer one (None: never), timed on chunks of random q, k, v: fresh ones and ones after a
    cached prefix of PREFIX tokens."""
    return TorchFrom(*(_first_torch_length(dtype, heads, kv_heads, head_dim, block_size, cached)
                       for cached in (0, PREFIX)))


def _first_torch_length(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                        block_size: int, cached: int) -> int | None:
    gen = torch.Generator().manual_seed(0)
    with choice.one_thread():
        winners = [choice.pick(choice.time_candidates(prefill_candidates(
            dtype, heads, kv_heads, head_dim, block_size, n, gen, cached))) for n in LENGTHS]
    start = None
    for n, winner in zip(reversed(LENGTHS), reversed(winners), strict=True):
        if winner != "torch":
            break
        start = n
    return start


def torch_prefill_from(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       block_size: int) -> TorchFrom:
    """The chunk lengths from which a step's prefill runs torch's attention, fresh and after a
    cached prefix (0: always; None: never), per PAGEDKV_KERNEL_CHOICE; measured once per class
    (and cached on disk)."""
    start = _torch_from_by_mode(dtype, heads, kv_heads, head_dim, block_size)
    _in_use[dtype, heads, kv_heads, head_dim, block_size] = start
    return start


def _torch_from_by_mode(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                        block_size: int) -> TorchFrom:
    mode = choice.choice_mode()
    if mode != "measure":
        return TorchFrom(0, 0) if mode == "onednn" else TorchFrom(None, None)
    key = attention_class(dtype, heads, kv_heads, head_dim, block_size)
    if key not in _torch_from:
        found = choice.cached_choice(
            "prefill_attention", key, _valid_entry,
            lambda: measure_prefill(dtype, heads, kv_heads, head_dim, block_size).lengths_json())
        amx = amx_available(head_dim, dtype)
        _torch_from[key] = TorchFrom(found["torch_from"], found["torch_from_after_prefix"],
                                     amx, amx and block_size % 16 == 0)
    return _torch_from[key]


@functools.cache
def amx_available(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the loaded build runs `amx_prefill_attention` for this head size and dtype on
    this CPU (AMX tiles compiled in and granted by the OS; bfloat16; head size a multiple of
    64)."""
    return bool(torch.ops.pagedkv_cpu.amx_prefill_supported(head_dim, dtype))


def describe_amx(dtype: torch.dtype, head_dim: int) -> str:
    """The start-up banner's words for the AMX kernel where a model of `dtype` and `head_dim`
    runs its fresh prompts on it (the default choice mode, a build and CPU with AMX), else ""."""
    if choice.choice_mode() != "measure" or not amx_available(head_dim, dtype):
        return ""
    return ("; fresh prompts' attention: amx_prefill_attention (AMX tiles)"
            "; shared prefixes' attention: amx_prefix_attention (AMX tiles, block sizes"
            " a multiple of 16)")


def amx_prefill_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_cache: torch.Tensor) -> bool:
    """Whether this step's fresh prompts (`fresh_prompt`) run the AMX kernel on q, k, v
    [T, heads, D]: heads contiguous, a cache of q's dtype, and the class's choice says so (see
    the module docstring)."""
    d = q.shape[2]
    if not amx_available(d, q.dtype) or k_cache.dtype != q.dtype or any(
            t.dtype != q.dtype or t.stride(2) != 1 or t.stride(1) != d for t in (q, k, v)):
        return False
    return torch_prefill_from(q.dtype, q.shape[1], k_cache.shape[0], q.shape[2],
                              k_cache.shape[2]).amx_fresh


def amx_prefix_ok(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this step's decodes q [S, heads, D] run their shared prefixes (cascade.py) on
    `amx_prefix_attention`: heads contiguous, a cache of q's dtype, and the class's choice says
    so (see the module docstring)."""
    d = q.shape[2]
    if (not amx_available(d, q.dtype) or k_cache.dtype != q.dtype or q.stride(2) != 1
            or q.stride(1) != d):
        return False
    return torch_prefill_from(q.dtype, q.shape[1], k_cache.shape[0], d,
                              k_cache.shape[2]).amx_prefix


def fresh_prompt(chunk: PrefillChunk, window: int | None) -> bool:
    """Whether `chunk` is a whole fresh prompt for the AMX kernel: from position 0, no window
    hiding any of its keys."""
    return chunk.start_pos == 0 and (window is None
                                     or window >= chunk.token_end - chunk.token_start)


def _valid_entry(entry: object) -> bool:
    """Whether a table file's entry holds both lengths (an older file's is measured again)."""
    fields = ("torch_from", "torch_from_after_prefix")
    return isinstance(entry, dict) and all(
        f in entry and (entry[f] is None or isinstance(entry[f], int)) for f in fields)


def native_prefill(q: torch.Tensor, k_cache: torch.Tensor,
                   prefills: Sequence[PrefillChunk]) -> bool:
    """Whether this step's prefill chunks (q [T, heads, D], a cache [kv_heads, blocks,
    block_size, D]) run the fused kernel rather than torch's attention (see the module
    docstring)."""
    start = torch_prefill_from(q.dtype, q.shape[1], k_cache.shape[0], q.shape[2],
                               k_cache.shape[2])
    for c in prefills:
        kind = start.fresh if c.start_pos == 0 else start.after_prefix
        if kind is not None and c.token_end - c.token_start >= kind:
            return False
    return True


def prefill_table() -> dict[str, TorchFrom]:
    """This process's measured classes: {attention class: first lengths for torch's}."""
    return dict(_torch_from)


def prefill_in_use() -> dict[str, TorchFrom]:
    """Every class this process ran a prefill of on the CPU's fused kernels, measured or
    forced: {attention class: first lengths for torch's (0: always; None: never)}."""
    return {attention_class(*key): start for key, start in _in_use.items()}
