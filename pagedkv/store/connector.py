"""The KV connector seam between the engine and the tiered store (vLLM's KVConnectorBase_V1 split).

Scheduler side (`StoreConnectorScheduler`, called by the Scheduler):
  1. `get_num_new_matched_tokens(request, n)`: after the device prefix hit of `n` tokens and
     before allocation, how many more prompt tokens the store holds (consecutive full blocks by
     chained hash, the first miss stops; the last prompt token is always computed).
  2. `update_state_after_alloc(request, n, num_external)`: once blocks are allocated for them,
     read those blocks' bytes from the store (verified) and plan their copy into the request's
     new device blocks. Returns the tokens really loaded: a block that is gone or corrupt ends
     the load there and the scheduler computes the rest (a store failure costs time only).
  3. `build_connector_meta(out, requests)`: the step's loads, and the full blocks this step
     computes (to be saved), for the worker side.
Worker side (`StoreConnectorWorker`, called by the ModelRunner):
  - `start_load_kv(meta, kv_cache)`: copy the loaded bytes into their device blocks, before
    the forward pass reads them (synchronous: the bytes are already in host memory).
  - `save_kv(meta, kv_cache)`: after the forward pass, snapshot the saved blocks (one gather, a
    copy) and hand it to the store's saver thread, which serializes and writes it: the step
    never waits for a tier.

A block's payload is `kv[:, :, :, block_id]` of the KV cache tensor (`pagedkv.model.kv_cache`,
block dimension 3), contiguous, as raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.store.tiered import BlockMeta, TieredKVStore

if TYPE_CHECKING:
    import torch

    from pagedkv.kv.manager import KVCacheManager
    from pagedkv.model.kv_cache import KVCache
    from pagedkv.sched.output import SchedulerOutput
    from pagedkv.sched.request import Request

BLOCK_DIM = 3  # of the KV cache tensor [layers, 2, kv_heads, blocks, block_size, head_dim]


@dataclass
class StoreConnectorMetadata:
    """One step's store work: (device block id, payload) to load, (device block id, meta) to save."""

    loads: list[tuple[int, bytes]] = field(default_factory=list)
    saves: list[tuple[int, BlockMeta]] = field(default_factory=list)


def _block_metas(request: Request, hashes: list[bytes], start: int, end: int,
                 block_size: int) -> list[BlockMeta]:
    tokens = request.all_token_ids
    return [BlockMeta(hashes[i], hashes[i - 1] if i > 0 else None,
                      tuple(tokens[i * block_size:(i + 1) * block_size]))
            for i in range(start, end)]


class StoreConnectorScheduler:
    """The scheduler's side; keeps the step's planned loads until `build_connector_meta`."""

    def __init__(self, store: TieredKVStore, kv_cache_manager: KVCacheManager) -> None:
        self.store = store
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self._loads: list[tuple[int, bytes]] = []
        self.num_loaded_tokens = 0
        self.num_failed_load_tokens = 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` that the store can provide."""
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs
        if end <= start:
            return 0
        hashes = self.kv.update_block_hashes(request)
        return self.store.lookup(hashes[start:end]) * bs

    def update_state_after_alloc(self, request: Request, num_computed_tokens: int,
                                 num_external_tokens: int) -> int:
        """Read the matched blocks and plan their loads; returns the tokens really loaded."""
        bs = self.block_size
        start = num_computed_tokens // bs
        end = start + num_external_tokens // bs
        hashes = self.kv.get_block_hashes(request.request_id)
        payloads = self.store.load(_block_metas(request, hashes, start, end, bs))
        block_ids = self.kv.get_block_ids(request.request_id)
        self._loads.extend(zip(block_ids[start:start + len(payloads)], payloads, strict=True))
        loaded = len(payloads) * bs
        self.num_loaded_tokens += loaded
        self.num_failed_load_tokens += num_external_tokens - loaded
        return loaded

    def build_connector_meta(self, out: SchedulerOutput,
                             requests: dict[str, Request]) -> StoreConnectorMetadata:
        """The step's loads (drained) and the blocks that become full and computed in it."""
        meta = StoreConnectorMetadata(loads=self._loads)
        self._loads = []
        bs = self.block_size
        for scheduled in out.scheduled:
            request = requests.get(scheduled.request_id)
            first = scheduled.start_pos // bs
            end = (scheduled.start_pos + scheduled.num_new_tokens) // bs
            if request is None or end <= first:
                continue
            hashes = self.kv.update_block_hashes(request)
            end = min(end, len(hashes))
            table = scheduled.block_table
            meta.saves.extend((table[i], m) for i, m in zip(
                range(first, end), _block_metas(request, hashes, first, end, bs), strict=True)
                if table[i] != 0)
        return meta


class StoreConnectorWorker:
    """The model runner's side: applies a step's loads and starts its saves."""

    def __init__(self, store: TieredKVStore) -> None:
        self.store = store

    def start_load_kv(self, meta: StoreConnectorMetadata | None, kv_cache: KVCache) -> None:
        """Copy the step's loaded blocks into their device blocks (mutates the KV cache)."""
        if meta is None or not meta.loads:
            return
        import torch

        from pagedkv.model.kv_quant import storage_view

        kv = kv_cache.kv
        ids = torch.tensor([b for b, _ in meta.loads], dtype=torch.long, device=kv.device)
        raw = bytearray(b"".join(p for _, p in meta.loads))
        kv = storage_view(kv)  # fp8: copied as bytes (CPU torch has no fp8 index_copy_)
        blocks = torch.frombuffer(raw, dtype=torch.uint8).view(kv.dtype)
        shape = (len(meta.loads), *kv.shape[:BLOCK_DIM], *kv.shape[BLOCK_DIM + 1:])
        blocks = blocks.view(shape).movedim(0, BLOCK_DIM)
        kv.index_copy_(BLOCK_DIM, ids, blocks.to(kv.device))

    def save_kv(self, meta: StoreConnectorMetadata | None, kv_cache: KVCache) -> None:
        """Snapshot the step's newly computed full blocks and queue them for saving."""
        if meta is None or not meta.saves:
            return
        import torch

        kv = kv_cache.kv
        ids = torch.tensor([b for b, _ in meta.saves], dtype=torch.long, device=kv.device)
        snapshot = kv.index_select(BLOCK_DIM, ids)  # a copy: later steps may reuse the blocks
        self.store.save_async([m for _, m in meta.saves], lambda: _payloads(snapshot))


def _payloads(snapshot: torch.Tensor) -> list[bytes]:
    """One bytes object per block of a [layers, 2, heads, n, block_size, dim] snapshot."""
    import torch

    blocks = snapshot.movedim(BLOCK_DIM, 0).contiguous().cpu()
    raw = blocks.view(torch.uint8).view(blocks.shape[0], -1).numpy()
    return [row.tobytes() for row in raw]
