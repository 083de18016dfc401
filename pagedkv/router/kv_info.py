"""Reading a backend's /kv_cache_info answer: what the router needs from it, or why it cannot
be used.

A `pagedkv serve` answers `{"block_size": int, "prefix_caching_hash_algo": str,
"num_gpu_blocks": int, "enable_prefix_caching": bool, ...}`. Anything else (a field missing, of
another type, a non-positive size, a body that is not a JSON object, an error status) is an odd
answer: `read_kv_info` raises ValueError naming what is wrong, and the router keeps routing to
that backend with no prefix credit (`Backend.kv_info_problem` says why, in the fleet view).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVInfo:
    """The fields of a /kv_cache_info answer the router reads."""

    block_size: int
    hash_algo: str
    num_gpu_blocks: int
    prefix_caching: bool


def _positive_int(info: dict[str, Any], key: str) -> int:
    value = info.get(key)
    if key not in info:
        raise ValueError(f"/kv_cache_info lacks {key}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"/kv_cache_info has {key}={value!r}, not a positive integer")
    return value


def read_kv_info(info: object) -> KVInfo:
    """The router's view of a /kv_cache_info answer (ValueError naming what is odd)."""
    if not isinstance(info, dict):
        raise ValueError(f"/kv_cache_info answered a {type(info).__name__}, not a JSON object")
    block_size = _positive_int(info, "block_size")
    num_gpu_blocks = _positive_int(info, "num_gpu_blocks")
    algo = info.get("prefix_caching_hash_algo")
    if not isinstance(algo, str) or not algo:
        raise ValueError(f"/kv_cache_info has prefix_caching_hash_algo={algo!r}, not a name")
    caching = info.get("enable_prefix_caching", True)
    if not isinstance(caching, bool):
        raise ValueError(f"/kv_cache_info has enable_prefix_caching={caching!r}, not a bool")
    return KVInfo(block_size, algo, num_gpu_blocks, caching)
