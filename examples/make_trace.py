"""Write a small synthetic trace in Mooncake's JSONL format (the format `pagedkv simulate` reads).

Each line: `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, the ids of the
prompt's 512-token blocks; requests that share leading ids share a prefix (here: a few
conversations whose turns grow, and system prompts shared by tenants), so the simulator's
prefix cache has something to hit. Deterministic: the same seed writes the same file.

    python examples/make_trace.py > examples/traces/sample_mooncake.jsonl
    python examples/make_trace.py --requests 2000 --seed 1 > /tmp/bigger.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys

BLOCK_TOKENS = 512  # Mooncake's hash_ids cover 512 tokens each


def make_trace(requests: int, rate: float, seed: int) -> list[dict]:
    """`requests` rows, Poisson arrivals at `rate` per second, a mix of multi-turn chats and
    single questions under a few shared system prompts."""
    rng = random.Random(seed)
    next_id = 1000
    system_prompts = [[i * 2, i * 2 + 1] for i in range(4)]  # 4 tenants, 2 blocks each
    conversations: list[list[int]] = []
    rows, clock = [], 0.0
    for _ in range(requests):
        clock += rng.expovariate(rate)
        if conversations and rng.random() < 0.5:  # the next turn of a conversation
            history = rng.choice(conversations)
        else:
            history = list(rng.choice(system_prompts))
            conversations.append(history)
        new_blocks = rng.randint(1, 3)
        history.extend(range(next_id, next_id + new_blocks))
        next_id += new_blocks
        tail = rng.randint(0, BLOCK_TOKENS - 1)
        rows.append({"timestamp": round(clock * 1000), "input_length": len(history) * BLOCK_TOKENS
                     - (BLOCK_TOKENS - tail if tail else 0),
                     "output_length": rng.randint(16, 400), "hash_ids": list(history)})
        if len(history) > 24:  # a conversation ends
            conversations.remove(history)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for row in make_trace(args.requests, args.rate, args.seed):
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
