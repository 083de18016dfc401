"""Which kernel runs a step's prefill attention on the CPU, chosen by measurement: the fused
tiled kernel (`paged_prefill_attention`, vdpbf16ps / AVX-512 dot products, reading the paged
cache in place) or torch's own attention on the chunks' K/V (attention.prefill_attention_all:
scaled_dot_product_attention, whose flash kernel runs on oneDNN/AMX where the CPU has it).

On an Intel CPU with AMX, torch's was measured faster in bfloat16 from about 64 query tokens
(2x at 256, 3x at 2,048) and the fused kernel faster below; elsewhere the fused kernel may win
throughout. So for each attention class (dtype, heads / KV heads, head size, block size) one
fresh chunk of each of LENGTHS query tokens is timed both ways (kernels/choice.py's one-thread
CPU-time timing, cached in its table file) and the step's prefill runs torch's from the first
length at which torch's wins at that length and every longer one, by its longest chunk.
PAGEDKV_KERNEL_CHOICE: "panel" and "isa" keep the fused kernel, "onednn" takes torch's always.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedkv.kernels import choice
from pagedkv.model.attention import PrefillChunk, prefill_attention

LENGTHS = (16, 32, 64, 128, 256, 512)

_torch_from: dict[str, int | None] = {}  # attention class -> first length for torch's
# (dtype, heads, KV heads, head size, block size) -> the length in use, measured or forced
_in_use: dict[tuple[torch.dtype, int, int, int, int], int | None] = {}


def attention_class(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                    block_size: int) -> str:
    """The table's key: "bfloat16 8/4x64 block 16"."""
    return f"{str(dtype).removeprefix('torch.')} {heads}/{kv_heads}x{head_dim} block {block_size}"


def prefill_candidates(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       block_size: int, n: int, gen: torch.Generator
                       ) -> dict[str, Callable[[], torch.Tensor]]:
    """{"native": the fused kernel's call, "torch": torch's}, each returning the attention
    [n, heads, D] of one fresh chunk of `n` random query tokens over itself (its K/V in a paged
    cache for the fused kernel)."""
    blocks = -(-n // block_size)
    q, k, v = (torch.randn(n, h, head_dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    k_cache, v_cache = (torch.zeros(kv_heads, blocks * block_size, head_dim, dtype=dtype)
                        for _ in range(2))
    k_cache[:, :n], v_cache[:, :n] = k.transpose(0, 1), v.transpose(0, 1)
    k_cache, v_cache = (c.view(kv_heads, blocks, block_size, head_dim) for c in (k_cache, v_cache))
    table = torch.arange(blocks)
    rows = (torch.tensor([0]), torch.tensor([n]), torch.tensor([n]))
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    chunk = PrefillChunk(0, n, 0, n, table)

    def native() -> torch.Tensor:
        torch.ops.pagedkv_cpu.paged_prefill_attention(q, k_cache, v_cache, table.view(1, -1),
                                                      *rows, 0, scale, out)
        return out

    def torch_own() -> torch.Tensor:
        return prefill_attention(q, k, v, k_cache, v_cache, chunk, scale, None)

    return {"native": native, "torch": torch_own}


def measure_prefill(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                    block_size: int) -> int | None:
    """The first of LENGTHS from which torch's attention beats the fused kernel at every
    longer one (None: never), timed on fresh chunks of random q, k, v."""
    gen = torch.Generator().manual_seed(0)
    with choice.one_thread():
        winners = [choice.pick(choice.time_candidates(prefill_candidates(
            dtype, heads, kv_heads, head_dim, block_size, n, gen))) for n in LENGTHS]
    start = None
    for n, winner in zip(reversed(LENGTHS), reversed(winners), strict=True):
        if winner != "torch":
            break
        start = n
    return start


def torch_prefill_from(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       block_size: int) -> int | None:
    """The longest-chunk length from which a step's prefill runs torch's attention (0: always;
    None: never), per PAGEDKV_KERNEL_CHOICE; measured once per class (and cached on disk)."""
    start = _torch_from_by_mode(dtype, heads, kv_heads, head_dim, block_size)
    _in_use[dtype, heads, kv_heads, head_dim, block_size] = start
    return start


def _torch_from_by_mode(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                        block_size: int) -> int | None:
    mode = choice.choice_mode()
    if mode != "measure":
        return 0 if mode == "onednn" else None
    key = attention_class(dtype, heads, kv_heads, head_dim, block_size)
    if key not in _torch_from:
        found = choice.cached_choice(
            "prefill_attention", key,
            lambda v: isinstance(v, dict) and (v.get("torch_from") is None
                                               or isinstance(v.get("torch_from"), int)),
            lambda: {"torch_from": measure_prefill(dtype, heads, kv_heads, head_dim,
                                                   block_size)})
        _torch_from[key] = found["torch_from"]
    return _torch_from[key]


def native_prefill(q: torch.Tensor, k_cache: torch.Tensor,
                   prefills: Sequence[PrefillChunk]) -> bool:
    """Whether this step's prefill chunks (q [T, heads, D], a cache [kv_heads, blocks,
    block_size, D]) run the fused kernel rather than torch's attention (see the module
    docstring)."""
    start = torch_prefill_from(q.dtype, q.shape[1], k_cache.shape[0], q.shape[2],
                               k_cache.shape[2])
    return start is None or max(c.token_end - c.token_start for c in prefills) < start


def prefill_table() -> dict[str, int | None]:
    """This process's measured classes: {attention class: first length for torch's}."""
    return dict(_torch_from)


def prefill_in_use() -> dict[str, int | None]:
    """Every class this process ran a prefill of on the CPU's fused kernels, measured or
    forced: {attention class: first length for torch's (0: always; None: never)}."""
    return {attention_class(*key): start for key, start in _in_use.items()}
