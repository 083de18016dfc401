"""What every attention backend is (`AttentionBackend`): what it can do, declared as fields
the runner reads, and the one call a step makes (`build_metadata`). A new backend declares
these and registers itself in `ATTENTION_BACKENDS` (backends/__init__.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from pagedkv.model.backends.step import StepSequences


class AttentionBackend(Protocol):
    """An attention backend, built for one device.

    `name`: its registry name; `supports_cuda_graphs`: its decode metadata is replayable in a
    captured CUDA graph (fixed-size tensors updated in place); `reads_cache_dtypes`: the
    quantized KV cache dtypes (canonical names: "int8", "fp8", "fp8_e4m3", ...) its kernels
    read in place (any other quantized cache is attended through `QuantizedKVBackend`);
    `fused`: whether its fused CPU kernels run now (the runner turns them on with
    `set_fused` once they are built; always False for a backend that has none)."""

    name: str
    device: torch.device
    supports_cuda_graphs: bool
    reads_cache_dtypes: frozenset[str]

    @property
    def fused(self) -> bool: ...

    def set_fused(self, on: bool) -> None:
        """Use the fused CPU kernels from the next step on (`on`), or not; a backend without
        fused kernels ignores it."""

    def build_metadata(self, step: StepSequences) -> Any:
        """The per-step metadata whose `attend(q, k, v, k_cache, v_cache, scale, window)`
        every layer calls."""
