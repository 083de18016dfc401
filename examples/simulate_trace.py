"""Replay a trace through the real scheduler on a virtual clock: one H100, then a sweep of KV
cache sizes, then the fewest small instances for an SLO. No GPU, no weights, a second or two.

    python examples/simulate_trace.py                               # the bundled sample trace
    python examples/simulate_trace.py --trace mooncake_conversation_trace.jsonl

The same as `pagedkv simulate TRACE ...` on the command line. The sample trace
(examples/traces/sample_mooncake.jsonl, Mooncake's JSONL format) is synthetic: 200 requests of
multi-turn chats under four shared system prompts; examples/make_trace.py writes it or a bigger one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedkv.cli import main as pagedkv

SAMPLE = Path(__file__).resolve().parent / "traces" / "sample_mooncake.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(SAMPLE))
    args = parser.parse_args()
    slo = ["--slo", "ttft=2,tpot=0.1"]
    print("== one simulated H100 (qwen3-8b)")
    pagedkv(["simulate", args.trace, *slo])
    print("\n== a smaller KV cache: where preemption and misses start")
    pagedkv(["simulate", args.trace, *slo, "--sweep", "num_blocks=200,400,800,1600"])
    print("\n== with 400 blocks each: the fewest instances behind the kv-aware router")
    pagedkv(["simulate", args.trace, *slo, "--num-gpu-blocks-override", "400",
             "--search", "instances", "--target", "0.9"])


if __name__ == "__main__":
    main()
