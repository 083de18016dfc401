"""The CPU attention backend: today's pure-torch paged attention (attention.py, cascade.py).

Decodes are gathered in cache-sized groups and attended with SDPA; prefill chunks one by one;
shared prefixes once per group (cascade attention). Tuned for CPU caches; it also runs on CUDA,
at one or more launches per request.
"""

from __future__ import annotations

import torch

from pagedkv.model.attention import AttentionMetadata, PrefillChunk
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.backends.table_rows import BlockTableRows


class TorchPagedBackend:
    """Builds `attention.AttentionMetadata` (its scratch buffers and the decodes' block-table
    tensor reused across steps: see table_rows.py)."""

    name = "torch"
    supports_cuda_graphs = False
    reads_cache_dtypes: frozenset[str] = frozenset()
    metadata_cls: type[AttentionMetadata] = AttentionMetadata

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fused = False  # no fused kernels
        self._workspace: dict = {}  # attention scratch buffers, reused across steps
        self._decode_tables = BlockTableRows(torch.long)

    def set_fused(self, on: bool) -> None:
        """No fused kernels: nothing to switch."""

    def build_metadata(self, step: StepSequences) -> AttentionMetadata:
        dev, nd = self.device, step.num_decodes
        dec_lens = step.seq_lens[:nd]
        dec_tables = self._decode_tables.build(step.block_tables[:nd])
        chunks, start = [], nd
        for n, seq_len, table in zip(step.num_new_tokens[nd:], step.seq_lens[nd:],
                                     step.block_tables[nd:], strict=True):
            used = table[: (seq_len + step.block_size - 1) // step.block_size]
            chunks.append(PrefillChunk(start, start + n, seq_len - n, seq_len,
                                       torch.tensor(used, dtype=torch.long).to(dev)))
            start += n
        return self.metadata_cls(
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=dev),
            num_decodes=nd,
            decode_seq_lens=torch.tensor(dec_lens, dtype=torch.long, device=dev),
            decode_block_tables=dec_tables.to(dev),
            prefills=chunks,
            block_size=step.block_size,
            decode_seq_lens_list=dec_lens,
            workspace_buffers=self._workspace,
        )
