"""The start-up lines of a weight load: what is being read (size on disk, files) and, once it
is in memory, its size, dtype, device and seconds. One pair per runner; a tensor-parallel rank
names itself (rank 0 logs in the engine core; the ranks of other machines in `pagedkv serve
--node-rank K`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pagedkv.kv.sizes import format_size
from pagedkv.model.loader import weight_files

logger = logging.getLogger("pagedkv.model.loader")


def _who(tensor_parallel: Any) -> str:
    return "" if tensor_parallel is None \
        else f"rank {tensor_parallel.rank} of {tensor_parallel.size}: "


def weights_loading(model_dir: str | Path, tensor_parallel: Any = None) -> float:
    """Log that `model_dir`'s weights start loading; returns the start time for
    `weights_loaded`."""
    files = weight_files(model_dir)
    size = sum(f.stat().st_size for f in files)
    logger.info("%sloading weights from %s: %s in %d file%s...", _who(tensor_parallel),
                model_dir, format_size(size), len(files), "" if len(files) == 1 else "s")
    return time.perf_counter()


def weights_loaded(started: float, weights_bytes: int, dtype: Any, device: Any,
                   tensor_parallel: Any = None) -> None:
    """Log the loaded weights' bytes in memory and the seconds since `started`."""
    logger.info("%sweights loaded: %s as %s on %s in %.1f s", _who(tensor_parallel),
                format_size(weights_bytes), str(dtype).removeprefix("torch."), device,
                time.perf_counter() - started)
