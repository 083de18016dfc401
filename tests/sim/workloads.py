"""Small trace workloads for the simulator tests: shared prefixes, bursts, long outputs."""

from __future__ import annotations

import random

from pagedkv.sim.traces import TraceRequest


def shared_prefix_trace(num: int = 14, seed: int = 0, block_tokens: int = 8,
                        gap: float = 0.004) -> list[TraceRequest]:
    """Requests in bursts; most share one of three leading block runs (a "system prompt"),
    some share a second level; lengths vary so blocks fill at different steps."""
    rng = random.Random(seed)
    out = []
    t = 0.0
    next_id = 100
    for _i in range(num):
        t += rng.choice((0.0, 0.0, gap, 3 * gap))
        family = rng.randrange(3)
        ids = [family, 10 + family * 3 + rng.randrange(2)]
        for _ in range(rng.randrange(0, 3)):
            ids.append(next_id)
            next_id += 1
        input_length = max(3, (len(ids) - 1) * block_tokens + rng.randrange(1, block_tokens + 1))
        out.append(TraceRequest(arrival=t, input_length=input_length,
                                output_length=rng.randrange(3, 40), block_ids=tuple(ids),
                                block_tokens=block_tokens))
    return out


MOONCAKE_HEAD = "tests/sim/data/mooncake_conversation_head40.jsonl"
_SIMULATE_WITHOUT_TORCH = (
    "import sys; sys.argv = ['pagedkv'] + sys.argv[1:];"
    "from pagedkv.cli import main; rc = main();"
    "assert 'torch' not in sys.modules, 'simulate imported torch'; sys.exit(rc)")


def simulate_cli_without_torch(*flags: str):  # -> subprocess.CompletedProcess
    """`pagedkv simulate` on the bundled Mooncake slice (llama-3-8b shape, 400 blocks, linear
    latency) plus `flags`, in a child process that fails if the command imported torch."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", _SIMULATE_WITHOUT_TORCH, "simulate", MOONCAKE_HEAD,
         "--scale-lengths", "0.0625", "--model", "llama-3-8b", "--num-gpu-blocks-override", "400",
         "--latency", "linear", *flags], capture_output=True, text=True, timeout=120)
