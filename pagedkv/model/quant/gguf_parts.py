"""The packed blocks of the GGUF tensors behind a (possibly fused) linear, read one way for every
packed format."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar

import numpy as np

Part = TypeVar("Part")


def gguf_parts(checkpoint: Any, sources: list[str], types_taken: Collection[int],
               read: Callable[[Any, int], Part]) -> list[Part] | None:
    """`read(rows, ggml_type)` of each of `sources`' GGUF tensors (its rows in the checkpoint's
    order), or None where one of them is not of `types_taken`. Reads nothing then."""
    from pagedkv.model.gguf.tensors import hf_rows

    gguf = checkpoint.gguf
    names = [checkpoint.gguf_name(source) for source in sources]
    types = gguf_types(checkpoint, sources)
    if not all(t in types_taken for t in types):
        return None
    return [read(hf_rows(gguf, source, name), t)
            for source, name, t in zip(sources, names, types, strict=True)]


def gguf_types(checkpoint: Any, sources: list[str]) -> list[int]:
    """The ggml types of `sources`' GGUF tensors."""
    return [checkpoint.gguf.tensors[checkpoint.gguf_name(source)].ggml_type
            for source in sources]


def narrowest_scales(scales: np.ndarray) -> np.ndarray:
    """`scales` as float16 where every value round-trips through it exactly (the file's own
    fp16 scales: half the bytes a decode step reads for them), else as float32."""
    wide = scales.astype(np.float32)
    half = wide.astype(np.float16)
    exact = bool(np.all(np.isfinite(half)) and np.array_equal(half.astype(np.float32), wide))
    return half if exact else wide
