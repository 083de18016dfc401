"""Shared helpers for the KV memory-system tests: a minimal request the manager accepts."""

from __future__ import annotations

from pagedkv.kv.manager import KVCacheManager


class FakeRequest:
    """Duck-types the fields KVCacheManager reads (see manager.KVRequest)."""

    def __init__(self, request_id: str, prompt: list[int], *, cache_salt: str | None = None,
                 lora_name: str | None = None) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_name = lora_name

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, *tokens: int) -> None:
        self.all_token_ids.extend(tokens)


def make_request(request_id: str, prompt, **kw) -> FakeRequest:
    return FakeRequest(request_id, list(prompt), **kw)


def prefill(mgr: KVCacheManager, req: FakeRequest, *, use_cache: bool = True):
    """Admit `req` like a scheduler: prefix hit, allocate the rest, mark all computed.

    Returns (new_blocks, num_hit_tokens); new_blocks is None when it did not fit.
    """
    hits, n = mgr.get_computed_blocks(req) if use_cache else ([], 0)
    new = mgr.allocate_slots(req, req.num_tokens - n, hits, n)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return new, n


def decode(mgr: KVCacheManager, req: FakeRequest, token: int):
    """Append one sampled token and allocate its slot (None when it did not fit)."""
    req.append(token)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return new
