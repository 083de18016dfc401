"""Attention backends: the registry from device type to the backend that runs attention there.

A backend is an `AttentionBackend` (base.py): its capabilities as fields, and
`build_metadata(step: StepSequences)`, returning the per-step metadata object whose
`attend(q, k, v, k_cache, v_cache, scale, window)` each layer calls. A new backend is a new
module plus one line here; modules are imported on first use, so Triton is needed only where
its backend runs.

  cpu       -> cpu_native.CpuNativeBackend (fused C++ decode attention and KV write, once
               pagedkv.kernels.cpu has built them; torch_paged's path until then)
  cpu_torch -> torch_paged.TorchPagedBackend (attention.py + cascade.py: gathers sized for CPU
               caches; the pure-torch reference)
  cuda -> triton_paged.TritonPagedBackend (two Triton launches per layer; CUDA-graph friendly)
"""

from __future__ import annotations

import importlib

import torch

from pagedkv.model.backends.base import AttentionBackend

ATTENTION_BACKENDS: dict[str, str] = {
    "cpu": "pagedkv.model.backends.cpu_native:CpuNativeBackend",
    "cpu_torch": "pagedkv.model.backends.torch_paged:TorchPagedBackend",
    "cuda": "pagedkv.model.backends.triton_paged:TritonPagedBackend",
}


def get_attention_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """The backend registered for `device.type` (or for the registry key `name` when given),
    built for `device`. Raises ValueError for an unknown key."""
    key = name or device.type
    if key not in ATTENTION_BACKENDS:
        raise ValueError(f"no attention backend {key!r}; known: {sorted(ATTENTION_BACKENDS)}")
    module, cls = ATTENTION_BACKENDS[key].split(":")
    return getattr(importlib.import_module(module), cls)(device)
