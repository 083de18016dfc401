"""CUDA graphs for decode steps (vLLM's and nano-vllm's scheme).

The decode forward pass (embedding, every layer, final norm) is captured once per batch size of
a ladder (`decode_batch_sizes`); a decode step of n requests is padded to the next captured size
and replayed. Inputs reach the graph through preallocated device buffers that every replay
reads: token ids, positions, slots, sequence lengths and block-table rows are written into
pinned host buffers and copied in with one asynchronous copy each, so a step costs no host
synchronisation (the only one is the caller reading the sampled tokens). Padding rows have
slot -1 (nothing is stored) and length 1 over block 0, so they touch no real request.

Needs the Triton attention backend (its metadata are a few fixed-shape tensors) and CUDA;
`ModelRunner` builds this only when both hold and `enforce_eager` is off.
"""

from __future__ import annotations

import bisect

import torch


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, every 16 above, the last
    one `max_num_seqs` (a padded batch wastes at most 1/8 of its rows past 64)."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_num_seqs + 1, 16))
    sizes = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
    return sizes


class DecodeCudaGraphs:
    """Captured decode forward passes over one model and KV cache; see the module docstring."""

    def __init__(self, model: torch.nn.Module, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 batch_sizes: list[int], max_blocks_per_seq: int, device: torch.device) -> None:
        self.model, self.kv_layers = model, kv_layers
        self.batch_sizes = sorted(batch_sizes)
        n, width = self.batch_sizes[-1], max(1, max_blocks_per_seq)
        self.max_blocks_per_seq = width
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        # Rows: token ids, positions, slots (int64 host staging); sequence lengths (int32).
        self._host = torch.zeros(3, n, dtype=torch.long, pin_memory=pin)
        self._host_seq_lens = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros(n, width, dtype=torch.int32, pin_memory=pin)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # decode steps served by a graph (for stats and tests)

    def _metadata(self, size: int):
        from pagedkv.model.backends.triton_paged import TritonAttentionMetadata

        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_layers,
                          self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every batch size, largest first, all sharing one memory pool. The buffers
        hold padding (slot -1), so capturing writes nothing into the KV cache."""
        pool = None
        for size in reversed(self.batch_sizes):
            self._forward(size)  # warm-up: compiles kernels, creates library handles
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def padded_size(self, num_decodes: int) -> int | None:
        """The captured size a batch of `num_decodes` replays at, or None when too large."""
        i = bisect.bisect_left(self.batch_sizes, num_decodes)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def replay(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
               block_tables: list[list[int]]) -> torch.Tensor:
        """Final hidden states [n, hidden] of a decode batch of n = len(input_ids) requests
        (mutates the KV cache). The tensor is the graph's own output buffer: valid until the
        next replay. Raises ValueError when no captured size holds n or a table is too wide."""
        n = len(input_ids)
        size = self.padded_size(n)
        if size is None or n == 0:
            raise ValueError(f"no captured decode graph for a batch of {n}")
        host = self._host.numpy()
        host[0, :n], host[0, n:size] = input_ids, 0
        host[1, :n], host[1, n:size] = positions, 0
        host[2, :n], host[2, n:size] = slot_mapping, -1
        lens = self._host_seq_lens.numpy()
        lens[:n], lens[n:size] = host[1, :n] + 1, 1
        tables = self._host_tables.numpy()
        width = max(len(t) for t in block_tables)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"block table of {width} blocks exceeds {self.max_blocks_per_seq}")
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        self.input_ids[:size].copy_(self._host[0, :size], non_blocking=True)
        self.positions[:size].copy_(self._host[1, :size], non_blocking=True)
        self.slot_mapping[:size].copy_(self._host[2, :size], non_blocking=True)
        self.seq_lens[:size].copy_(self._host_seq_lens[:size], non_blocking=True)
        self.block_tables[:n, :width].copy_(self._host_tables[:n, :width], non_blocking=True)
        self._graphs[size].replay()
        self.num_replays += 1
        return self._outputs[size][:n]
