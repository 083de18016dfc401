"""A block's payload: its raw KV bytes, as `bytes` (read from disk or Redis) or a 1-D uint8
tensor (a row of `KVCache.read_blocks`, or of the host tier's slot pool). The helpers here let
every tier and the connector accept either without caring which."""

from __future__ import annotations

import numpy as np
import torch

Payload = bytes | torch.Tensor


def payload_nbytes(payload: Payload) -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)


def payload_buffer(payload: Payload) -> bytes | memoryview:
    """The payload as a buffer for byte-level codecs and file writes (no copy for a CPU tensor)."""
    if isinstance(payload, torch.Tensor):
        return memoryview(payload.cpu().numpy())
    return payload


def copy_payload_into(row: torch.Tensor, payload: Payload) -> None:
    """Copy `payload` into `row`, a 1-D uint8 CPU tensor of the same size (mutates row)."""
    if isinstance(payload, torch.Tensor):
        row.copy_(payload)
    else:  # numpy accepts read-only buffers without a copy or a warning
        row.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)


def host_rows(num_rows: int, row_bytes: int, pin_memory: bool) -> torch.Tensor:
    """An uninitialised uint8 host tensor [num_rows, row_bytes]; pinned (page-locked, so copies
    to and from a CUDA device can be asynchronous) when `pin_memory`."""
    return torch.empty((num_rows, row_bytes), dtype=torch.uint8, pin_memory=pin_memory)


def rows_to_host(rows: torch.Tensor, pin_memory: bool) -> tuple[torch.Tensor, object | None]:
    """Start copying device `rows` to host memory. Returns (host rows, a CUDA event to
    `synchronize()` before reading them, or None when they are readable now). On CPU the rows
    are already host memory and are returned as they are."""
    if rows.device.type == "cpu":
        return rows, None
    host = host_rows(rows.shape[0], rows.shape[1], pin_memory)
    host.copy_(rows, non_blocking=pin_memory)
    if not pin_memory:  # a pageable copy is synchronous
        return host, None
    event = torch.cuda.Event()
    event.record()
    return host, event


def pin_host_memory(device: torch.device) -> bool:
    """Whether host buffers feeding a KV cache on `device` are pinned (CUDA only)."""
    return device.type == "cuda"
