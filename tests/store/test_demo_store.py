"""`make demo`'s tiered-store part: a real Redis started and stopped by the demo, and a prefix
computed by one engine served from it to the next (a restart)."""

from __future__ import annotations

import pytest
import redis

from pagedkv.demo import print_store_demo, run_store_demo


def test_store_demo_serves_the_prefix_from_redis_after_a_restart(tiny_llama, capsys):
    result = run_store_demo(str(tiny_llama), max_tokens=2)
    cold, restart = result["runs"]
    assert cold["prompt_tokens"] == restart["prompt_tokens"] > 32
    full_blocks = cold["prompt_tokens"] // 16
    assert cold["cached"] == 0 and cold["tier"]["blocks_written"] == full_blocks
    assert restart["cached"] == (restart["prompt_tokens"] - 1) // 16 * 16  # all but the last token
    assert restart["tier"]["hits"] == restart["cached"] // 16
    with pytest.raises(redis.ConnectionError):  # the demo stopped its server
        redis.Redis.from_url(result["url"], socket_connect_timeout=1).ping()
    print_store_demo(result)
    printed = capsys.readouterr().out
    assert f"{restart['cached']} served from the store" in printed
