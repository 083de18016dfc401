"""Explain a prefix-cache miss: block by block, where a prompt's KV is and why a block is not
on the device (issue 23, `POST /v1/cache/explain`). Reads only; runs in the engine loop thread.

For each full block of the prompt (hashed exactly as a request's: salt in the first block,
LoRA name in every block) the answer says where its KV is: `device` (in the prefix cache now),
a store tier (`host`, `disk`, `redis`: what the tier is named), or `nowhere`. A block that is
not on the device gets a reason, in this order of evidence:

- `evicted`: its hash is in the eviction ring (when, which policy, and for which request when
  that request had the caller's `cache_salt`);
- `different_tokens`: the nearest recent request with the caller's `cache_salt` had the same
  blocks before this one and a full block of other tokens here (another tokenization?);
- `never_computed`: none of the above.
A block on the device but after a missing one cannot be used (the cache matches a leading
run: `unreachable`). The trailing tokens that do not fill a block are `partial_block` (never
cached). The answer is bounded by the ring and `recent_prompts`, never by all history.

No answer is an oracle of another tenant's prompts: the history compared is the caller's own
`cache_salt`'s (unsalted callers: the unsalted requests', which share their cache anyway), never
another salt's, and nothing is finer than whole blocks, the granularity the cache itself shows
(no token position inside a block, nothing about a request shorter than the block compared).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.kv.eviction_log import EvictionRecord
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


def _nearest(recent: Sequence[RecentPrompt], token_ids: Sequence[int], block_size: int
             ) -> tuple[RecentPrompt | None, int]:
    """The newest recent prompt (of the caller's salt's) that shares the most whole blocks with
    `token_ids` and has a full block after them, and that number of blocks. Only whole blocks
    decide (how many tokens match inside a block never changes the answer)."""
    best, best_blocks = None, -1
    for prompt in reversed(recent):  # newest first; a tie keeps the newest
        shared = _common_prefix(prompt.token_ids, token_ids) // block_size
        if shared > best_blocks and len(prompt.token_ids) >= (shared + 1) * block_size:
            best, best_blocks = prompt, shared
    return best, max(best_blocks, 0)


def _evicted(record: EvictionRecord, now: float, cache_salt: str | None) -> dict[str, Any]:
    """The fields of an `evicted` block; the request that needed the room is named only when
    it had the caller's salt (else it may be another tenant's)."""
    for_request = record.for_request if record.for_salt == cache_salt else None
    whom = f"request {for_request!r}" if for_request is not None else "another request"
    return dict(reason="evicted", evicted_at=record.time,
                evicted_seconds_ago=round(now - record.time, 3), policy=record.policy,
                evicted_for_request=for_request,
                detail=f"evicted {now - record.time:.1f} s ago by the {record.policy} "
                       f"policy to make room for {whom}")


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
    recent = [p for p in kv.recent_prompts if p.cache_salt == cache_salt]  # the caller's own
    same, same_block = _nearest(recent, token_ids, bs)  # it differs in block `same_block`
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
            entry.update(_evicted(record, now, cache_salt))
        elif same is not None and i == same_block:
            entry.update(reason="different_tokens", nearest_request=same.request_id,
                         detail=f"the nearest recent request with this cache_salt (request "
                                f"{same.request_id!r}) had the same blocks before this one and "
                                f"other tokens in this one (another tokenization?)")
        else:
            salted = "with this cache_salt " if cache_salt is not None else ""
            entry.update(reason="never_computed",
                         detail=f"no recent request {salted}computed these tokens")
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
