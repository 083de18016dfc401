"""What the dashboard asks the engine core, as utility calls (`EngineCore.dashboard`): the same
calls in-process and across the core process (pagedkv/engine/utility.py), so the page works in
both `--engine-core` modes. Every method runs between the core's steps, in the thread that steps
it, and returns plain JSON-ready data.
"""

from __future__ import annotations

from typing import Any

from pagedkv.engine.block_feed import BlockFeed, block_table
from pagedkv.kv.explain import explain_prompt


class DashboardCalls:
    """The dashboard's view of one engine core: its block feed and the cache explanations."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.feed = BlockFeed()

    def subscribe(self) -> list[Any]:
        """[subscriber id, snapshot]; attaches the pools' recorders when first (see BlockFeed)."""
        sub, snap = self.feed.subscribe(self.core)
        return [sub, snap]

    def unsubscribe(self, sub: int) -> None:
        """The last one out detaches the recorders. Unknown ids are ignored."""
        self.feed.unsubscribe(self.core, sub)

    def drain(self, sub: int) -> dict[str, Any]:
        """`sub`'s update since its last drain (ValueError for an unknown id)."""
        return self.feed.drain(self.core, sub)

    def block_table(self, request_id: str) -> dict[str, Any] | None:
        """A live request's block table, None for an unknown id."""
        return block_table(self.core, request_id)

    def explain(self, token_ids: list[int], cache_salt: str | None) -> dict[str, Any]:
        """Where these prompt tokens' KV is, block by block, and the engine facts a miss may
        depend on (KV dtype, dtype, hash algorithm). ValueError for an empty prompt."""
        answer = explain_prompt(self.core.scheduler.kv_cache_manager, token_ids, cache_salt,
                                store=self.core.kv_store)
        args = self.core.args
        answer.update(kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
                      prefix_caching_hash_algo=args.prefix_caching_hash_algo)
        return answer

    def explain_recent(self, request_id: str) -> dict[str, Any] | None:
        """`explain` of a recent finished request's prompt, None when it is not among them."""
        for prompt in reversed(self.core.scheduler.kv_cache_manager.recent_prompts):
            if prompt.request_id == request_id:
                return self.explain(prompt.token_ids, prompt.cache_salt)
        return None
