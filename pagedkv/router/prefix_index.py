"""Which backend holds which KV block (`pagedkv.engine.placement.prefix_index`)."""

from __future__ import annotations

from pagedkv.engine.placement.prefix_index import (
    DEFAULT_MAX_MEDIA,
    DEFAULT_MAX_MEDIUM_BLOCKS,
    NEVER,
    SHARED,
    PrefixIndex,
    PrefixMatch,
)

__all__ = ["DEFAULT_MAX_MEDIA", "DEFAULT_MAX_MEDIUM_BLOCKS", "NEVER", "SHARED", "PrefixIndex",
           "PrefixMatch"]
