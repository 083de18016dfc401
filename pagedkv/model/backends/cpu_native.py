"""The CPU attention backend with the fused C++ kernels (pagedkv/kernels/cpu_ops.cpp).

Decodes read K/V straight from the paged cache, one block at a time with an online softmax
(`paged_decode_attention`: no gathered copy, no mask tensors, the query heads of a KV head
sharing each block's loads), and the new K/V go into their slots in one pass (`write_kv_`).
Shared prefixes keep cascade attention (cascade.py): the kernel attends each decode to its own
blocks after the shared ones and returns their log-sum-exp, merged with the prefix part.
Prefill chunks use the pure-torch path of torch_paged.py (SDPA's flash kernel already reads
them well).

Until the kernels are loaded (pagedkv.kernels.cpu builds them on first use), or when the
runner turns `native` off, this backend is exactly torch_paged's.
"""

from __future__ import annotations

import torch

from pagedkv.model.attention import AttentionMetadata, prefill_attention_all
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.backends.torch_paged import TorchPagedBackend
from pagedkv.model.cascade import merge_states, shared_prefix_attention


class NativeAttentionMetadata(AttentionMetadata):
    """AttentionMetadata whose `attend` runs the fused kernels for the KV write and decodes."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        torch.ops.pagedkv_cpu.write_kv_(k, v, k_cache, v_cache, self.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = self.num_decodes
        if nd:
            self._decode(q[:nd], k_cache, v_cache, scale, window, out[:nd])
        prefill_attention_all(q, k, v, k_cache, v_cache, self, scale, window, out)
        return out

    def _first_positions(self, window: int | None) -> tuple[torch.Tensor, list]:
        """(first key position each decode attends to here [num_decodes], the shared-prefix
        groups attended separately), once per step per window (a window wider than every
        decode hides nothing and counts as none)."""
        key = ("native_first", window)
        if key not in self._mask_cache:
            lens = self.decode_seq_lens_list or self.decode_seq_lens.tolist()
            if window is None or window >= max(lens):
                shared = self.shared_prefixes()
                first = [0] * len(lens)
                for group in shared:
                    for r in group.rows:
                        first[r] = group.num_blocks * self.block_size
            else:
                shared, first = [], [max(0, n - window) for n in lens]
            self._mask_cache[key] = (torch.tensor(first, dtype=torch.long), shared)
        return self._mask_cache[key]

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scale: float, window: int | None, out: torch.Tensor) -> None:
        first, shared = self._first_positions(window)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if shared else None
        torch.ops.pagedkv_cpu.paged_decode_attention(
            q, k_cache, v_cache, self.decode_block_tables, first, self.decode_seq_lens, scale,
            out, lse)
        for group in shared:
            rows = group.index()
            o_p, lse_p = shared_prefix_attention(q[rows], k_cache, v_cache, group, scale)
            out[rows] = merge_states(out[rows], lse[rows], o_p, lse_p)


class CpuNativeBackend(TorchPagedBackend):
    """torch_paged's metadata, or the fused kernels' while `native` is set (by the runner,
    between steps, once the kernels are loaded)."""

    name = "cpu_native"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.native = False

    def build_metadata(self, step: StepSequences) -> AttentionMetadata:
        self.metadata_cls = NativeAttentionMetadata if self.native else AttentionMetadata
        return super().build_metadata(step)
