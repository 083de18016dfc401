"""Explain a prefix-cache miss: block by block, where a prompt's KV is and why a block is not
on the device (issue 23, `POST /v1/cache/explain`). Reads only; runs in the engine loop thread.

For each full block of the prompt (hashed exactly as a request's: salt in the first block,
LoRA name in every block) the answer says where its KV is: `device` (in the prefix cache now),
a store tier (`host`, `disk`, `redis`: what the tier is named), or `nowhere`. A block that is
not on the device gets a reason, in this order of evidence:

- `evicted`: its hash is in the eviction ring (when, which policy, for which request);
- `different_cache_salt`: a recent request had the same tokens up to this block's end but
  another `cache_salt`;
- `different_tokens`: the recent request with the longest common token prefix differs inside
  this block (`first_differing_token` is the prompt position);
- `never_computed`: none of the above.
A block on the device but after a missing one cannot be used (the cache matches a leading
run: `unreachable`). The trailing tokens that do not fill a block are `partial_block` (never
cached). The answer is bounded by the ring and `recent_prompts`, never by all history.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.kv.manager import KVCacheManager, RecentPrompt
from pagedkv.kv.observer import short_hash


@dataclass
class _Prompt:
    all_token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None = None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _nearest(recent: Sequence[RecentPrompt], token_ids: Sequence[int], salt: str | None,
             same_salt: bool) -> tuple[RecentPrompt | None, int]:
    """The recent prompt (with the same salt, or with another) sharing the longest token
    prefix with `token_ids`, and that length."""
    best, best_len = None, -1
    for prompt in recent:
        if (prompt.cache_salt == salt) != same_salt:
            continue
        n = _common_prefix(prompt.token_ids, token_ids)
        if n > best_len:
            best, best_len = prompt, n
    return best, max(best_len, 0)


def explain_prompt(kv: KVCacheManager, token_ids: Sequence[int], cache_salt: str | None = None,
                   lora_name: str | None = None, store: Any = None,
                   now: float | None = None) -> dict[str, Any]:
    """The explanation as a JSON-ready dict (see the module docstring). `store` is the engine's
    `TieredKVStore` or None. ValueError for an empty prompt."""
    if not token_ids:
        raise ValueError("the prompt has no tokens to explain")
    now = time.time() if now is None else now
    bs = kv.block_size
    token_ids = list(token_ids)
    hashes = kv.hasher(_Prompt(token_ids, cache_salt, lora_name), []) if kv.enable_caching else []
    cached = kv.pool.cached_block_hash_to_block
    pins = kv.pins.pin_counts()
    tier_hits: list[str | None] = [None] * len(hashes)
    if store is not None and hashes:
        for tier in store.tiers:
            missing = [i for i, t in enumerate(tier_hits) if t is None]
            if not missing:
                break
            found = tier.contains_many([store.key(hashes[i]) for i in missing])
            for i, hit in zip(missing, found, strict=True):
                if hit:
                    tier_hits[i] = tier.name
    recent = list(kv.recent_prompts)
    same, same_len = _nearest(recent, token_ids, cache_salt, True)
    other, other_len = _nearest(recent, token_ids, cache_salt, False)
    max_hit_blocks = (len(token_ids) - 1) // bs  # the last token is always computed
    blocks: list[dict[str, Any]] = []
    leading = True
    for i, block_hash in enumerate(hashes):
        start, end = i * bs, (i + 1) * bs
        entry: dict[str, Any] = {"index": i, "tokens": [start, end], "hash": short_hash(block_hash)}
        block = cached.get(block_hash)
        if block is not None:
            entry.update(where="device", device_block=block.block_id, ref_cnt=block.ref_cnt,
                         pinned=pins.get(block.block_id, 0) > 0)
            if not leading:
                entry.update(reason="unreachable", detail="on the device, but an earlier block "
                             "is not: the prefix cache matches a leading run of blocks only")
            elif i >= max_hit_blocks:
                entry.update(reason="last_token_recomputed", detail="cached, but the prompt "
                             "ends here and its last token is always computed")
            else:
                entry["reason"] = "hit"
            blocks.append(entry)
            continue
        leading = False
        entry["where"] = tier_hits[i] or "nowhere"
        record = kv.eviction_log.lookup(block_hash)
        if record is not None:
            entry.update(reason="evicted", evicted_at=record.time,
                         evicted_seconds_ago=round(now - record.time, 3), policy=record.policy,
                         evicted_for_request=record.for_request,
                         detail=f"evicted {now - record.time:.1f} s ago by the {record.policy} "
                                f"policy to make room for request {record.for_request!r}")
        elif other is not None and other_len >= end and same_len < end:
            entry.update(reason="different_cache_salt", nearest_request=other.request_id,
                         detail=f"request {other.request_id!r} had the same tokens with another "
                                f"cache_salt (salted prefixes are never shared)")
        elif same is not None and start <= same_len < end and same_len < len(same.token_ids):
            entry.update(reason="different_tokens", first_differing_token=same_len,
                         nearest_request=same.request_id,
                         detail=f"the nearest computed prefix (request {same.request_id!r}) "
                                f"differs from token {same_len} on (another tokenization?)")
        else:
            entry.update(reason="never_computed",
                         detail="no request computed these tokens (within the recent window)")
        if entry["where"] != "nowhere":
            entry["detail"] += f"; a copy is in the {entry['where']} tier (loaded on admission)"
        blocks.append(entry)
    num_full = len(token_ids) // bs
    partial = None
    if len(token_ids) % bs:
        partial = {"tokens": [num_full * bs, len(token_ids)], "reason": "partial_block",
                   "detail": f"{len(token_ids) % bs} tokens do not fill a block of {bs}: "
                             f"only full blocks are cached"}
    hit_blocks = 0
    for entry in blocks[:max_hit_blocks]:
        if entry["reason"] != "hit":
            break
        hit_blocks += 1
    return {"block_size": bs, "num_tokens": len(token_ids), "num_full_blocks": num_full,
            "prefix_caching": kv.enable_caching, "cache_salt": cache_salt,
            "num_device_hit_tokens": hit_blocks * bs, "blocks": blocks, "partial_block": partial,
            "eviction_log": {"policy": kv.eviction_log.policy, "records": len(kv.eviction_log),
                             "capacity": kv.eviction_log.capacity},
            "recent_prompts": len(recent)}
