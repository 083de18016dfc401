"""The paged KV cache tensors on the device, and the host (swap) copy of the same layout.

Layout: one zero-filled tensor [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
(index 0 of dim 1 holds keys, 1 values). Layer i's caches are the views `kv[i, 0]`, `kv[i, 1]`
of shape [num_kv_heads, num_blocks, block_size, head_dim], so a token's slot
(`block_id * block_size + offset`) is one column of the [heads, num_blocks * block_size, dim]
view (see attention.py for why heads come first). A block is `kv[:, :, :, block_id]`. Block 0 is the null block: the KV manager never hands it out, and block
tables are padded with it; being zero-filled, masked reads of it never make NaNs.
The host cache has the same layout with `host_pool_num_blocks(num_host_blocks)` blocks (the
host pool's null block 0 plus `num_host_blocks` usable ones, pinned memory with CUDA): the same
number that sizes the KV manager's host pool, so every host id it hands out has a slot.
An fp8 cache (kv_cache_dtype) has the same layout in fp8 in both places: swapping and copying
move its bytes as they are, and `scales` (set by the runner) says what they mean. An int8 cache
(kv_int8.py) also has `scales_kv` [num_layers, 2, num_kv_heads, num_blocks, block_size] float32
(and `host_scales_kv`): one scale per token, head and K/V, moved with its block by every block
move here, and the tail of each block's row in `read_blocks` / `write_blocks`.
"""

from __future__ import annotations

import ctypes

import torch

from pagedkv.config.dtypes import kv_scale_bytes
from pagedkv.kv.block_pool import host_pool_num_blocks
from pagedkv.kv.spec import FullAttentionSpec, KVCacheSpec
from pagedkv.model.config import kv_cache_torch_dtype
from pagedkv.model.kv_int8 import PerTokenScales
from pagedkv.model.kv_quant import KVScales, storage_view

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the untouched CPU memory of `t` with 2 MiB pages (madvise
    MADV_HUGEPAGE on its whole 2 MiB-aligned pages; transparent huge pages in "madvise" mode
    only serve memory asked for so). A block table scatters a request's blocks over the whole
    cache, and with 4 KiB pages each block read then costs TLB misses. Returns whether the
    advice was taken; elsewhere (not Linux, CUDA, too small) it does nothing."""
    if t.device.type != "cpu" or t.nbytes < 2 * HUGE_PAGE_BYTES:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        start = -(-t.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (t.data_ptr() + t.nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                            _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), its CPU memory advised for huge pages before it is first touched."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()


class KVCache:
    """Device KV blocks plus host swap blocks; block moves act on every layer at once."""

    # The layout's one statement: dims of `kv`, and which of them indexes blocks.
    LAYOUT = ("layers", "kv", "kv_heads", "blocks", "block_size", "head_dim")
    BLOCK_DIM = LAYOUT.index("blocks")

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_host_blocks: int = 0, per_token_scales: bool = False) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an integer >= 0, got {num_host_blocks!r}")
        self.num_blocks, self.block_size, self.num_host_blocks = num_blocks, block_size, num_host_blocks
        self.num_host_slots = host_pool_num_blocks(num_host_blocks)  # host ids 0..slots-1
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
        self.kv = zeros_in_huge_pages(shape, dtype, device)
        host_shape = (num_layers, 2, num_kv_heads, self.num_host_slots, block_size, head_dim)
        pin = device.type == "cuda" and num_host_blocks > 0
        self.host_kv = torch.zeros(host_shape, dtype=dtype, device="cpu", pin_memory=pin)
        self.layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(num_layers)]
        # int8 caches: per-token-head scales beside the blocks (kv_int8.py); None otherwise.
        self.scales_kv: torch.Tensor | None = None
        self.host_scales_kv: torch.Tensor | None = None
        if per_token_scales:
            self.scales_kv = zeros_in_huge_pages(shape[:-1], torch.float32, device)
            self.host_scales_kv = torch.zeros(host_shape[:-1], dtype=torch.float32,
                                              device="cpu", pin_memory=pin)
        # fp8 caches: each layer's scales (kv_quant), set once by the runner; None otherwise.
        self.scales: list[KVScales] | None = None

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, *, num_blocks: int, device: torch.device,
                  num_host_blocks: int = 0) -> KVCache:
        """The cache the KV spec describes: its layers, KV heads, head size, block size and
        dtype, so `nbytes == num_blocks * spec.page_size_bytes` (the bytes the planner
        counted are the bytes allocated, int8 scales included). Raises ValueError for a spec this layout cannot hold
        (multi-head latent attention)."""
        if not isinstance(spec, FullAttentionSpec):  # sliding-window specs are full-attention
            raise ValueError(f"no paged KV layout for a {spec.kind!r} KV cache spec")
        return cls(num_layers=spec.num_layers, num_blocks=num_blocks, block_size=spec.block_size,
                   num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
                   dtype=kv_cache_torch_dtype(spec.dtype), device=device,
                   num_host_blocks=num_host_blocks,
                   per_token_scales=kv_scale_bytes(spec.dtype) > 0)

    @property
    def nbytes(self) -> int:
        """Device bytes of the cache: the blocks plus, for int8, their scales."""
        return self.kv.nbytes + (0 if self.scales_kv is None else self.scales_kv.nbytes)

    def layer_scales(self) -> list[PerTokenScales] | None:
        """Each layer's int8 scale caches (views of `scales_kv`), None for other formats."""
        if self.scales_kv is None:
            return None
        return [PerTokenScales(self.scales_kv[i, 0], self.scales_kv[i, 1])
                for i in range(self.scales_kv.shape[0])]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def dtype_tag(self) -> str:
        """What the cache's bytes mean: its torch dtype, and for fp8 every layer's scales (part
        of the offload tiers' keys, so a block is only ever read back with its own scales)."""
        tag = str(self.kv.dtype)
        if self.scales_kv is not None:
            tag += ":per-token-head-float32-scales"
        if self.scales is not None:
            tag += ":" + ",".join(f"{s.k_scale!r}/{s.v_scale!r}" for s in self.scales)
        return tag

    def _ids(self, ids: list[int], limit: int, what: str) -> torch.Tensor:
        bad = [i for i in ids if not 0 <= i < limit]
        if bad:
            raise ValueError(f"{what} block id {bad[0]} out of range [0, {limit})")
        return torch.tensor(ids, dtype=torch.long)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks for each (device_id, host_id) (mutates host_kv)."""
        if not mapping:
            return
        src = self._ids([s for s, _ in mapping], self.num_blocks, "device")
        dst = self._ids([d for _, d in mapping], self.num_host_slots, "host")
        self.host_kv[:, :, :, dst] = self.kv[:, :, :, src.to(self.device)].to("cpu")
        if self.scales_kv is not None:
            self.host_scales_kv[:, :, :, dst] = self.scales_kv[:, :, :, src.to(self.device)].to("cpu")

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks for each (host_id, device_id) (mutates kv)."""
        if not mapping:
            return
        src = self._ids([s for s, _ in mapping], self.num_host_slots, "host")
        dst = self._ids([d for _, d in mapping], self.num_blocks, "device")
        self.kv[:, :, :, dst.to(self.device)] = self.host_kv[:, :, :, src].to(self.device)
        if self.scales_kv is not None:
            self.scales_kv[:, :, :, dst.to(self.device)] = \
                self.host_scales_kv[:, :, :, src].to(self.device)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device block src to dst for each (src, dst) (copy-on-write; mutates kv)."""
        if not mapping:
            return
        src = self._ids([s for s, _ in mapping], self.num_blocks, "device").to(self.device)
        dst = self._ids([d for _, d in mapping], self.num_blocks, "device").to(self.device)
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]
        if self.scales_kv is not None:
            self.scales_kv[:, :, :, dst] = self.scales_kv[:, :, :, src]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copies of device blocks `block_ids` as rows of raw bytes: a new uint8 tensor
        [len(block_ids), page_size_bytes] on the KV device (every layer's K and V of one block
        per row, then its int8 scales if any; later writes to the cache never change it)."""
        ids = self._ids(block_ids, self.num_blocks, "device").to(self.device)
        blocks = self.kv.movedim(self.BLOCK_DIM, 0)[ids]  # advanced indexing: a contiguous copy
        rows = blocks.view(len(block_ids), -1).view(torch.uint8)
        if self.scales_kv is None:
            return rows
        scales = self.scales_kv.movedim(self.BLOCK_DIM, 0)[ids].reshape(len(block_ids), -1)
        return torch.cat([rows, scales.view(torch.uint8)], dim=1)

    def write_blocks(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """Overwrite device blocks `block_ids` with `rows` as `read_blocks` returns them (uint8,
        any device; from pinned host memory the copy is asynchronous on the current CUDA
        stream, so the forward pass that follows sees it). Mutates kv (and scales_kv)."""
        n = len(block_ids)
        block_bytes = self.nbytes // self.num_blocks
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (n, block_bytes):
            raise ValueError(f"rows must be uint8 [{n}, {block_bytes}], got "
                             f"{rows.dtype} {tuple(rows.shape)}")
        ids = self._ids(block_ids, self.num_blocks, "device").to(self.device)
        src = rows.to(self.device, non_blocking=True).contiguous()
        data_bytes = self.kv.nbytes // self.num_blocks
        # A view, so index_copy_ writes the cache; fp8 as its bytes (CPU has no fp8 index_copy_).
        by_block = storage_view(self.kv).movedim(self.BLOCK_DIM, 0)
        data = src[:, :data_bytes].contiguous().view(by_block.dtype)
        by_block.index_copy_(0, ids, data.view(n, *by_block.shape[1:]))
        if self.scales_kv is not None:
            scales_by_block = self.scales_kv.movedim(self.BLOCK_DIM, 0)
            scales = src[:, data_bytes:].contiguous().view(torch.float32)
            scales_by_block.index_copy_(0, ids, scales.view(n, *scales_by_block.shape[1:]))
