"""How many waiting prompt tokens a step starts (`prefill_batching`).

"fill" is vLLM's rule: waiting prompts are admitted while the step's token budget lasts, the
last one chunked to use it all.

"spread" (the default on CPU: "auto", `resolve_mode`) sizes the step's new prefill work for
the queue's mean time to first token. With a step costing `overhead + tokens` (in prompt
tokens of compute: the step's fixed cost and its decodes, `prefill_step_overhead_tokens +
decodes x prefill_decode_overhead_tokens`), a queue of `Q` prompt tokens started `t` tokens a
step reaches its first tokens, on average, after about `(Q / t + 1) / 2` steps of
`overhead + t`; that is least at `t = sqrt(Q x overhead)`. So a step starts whole prompts until
it holds that many new tokens (at least one prompt): a wave of a few prompts beside running
decodes is spread over several smaller steps, and the requests it releases later arrive spread
out too, each prefilled beside the others' decodes; a queue large against the overhead still
fills the budget. A prompt that the rest of the budget would cut waits for the next step rather
than be chunked when that step holds it and the whole queue behind it: its first token would
wait for that step anyway, and this step ends sooner for the prompts it finishes.
What a request samples never depends on the rule; only when its prompt runs.

The trade: in a closed loop at one throughput, mean end-to-end latency (TTFT + (outputs - 1)
x TPOT) is fixed, so the prefill time "spread" takes out of the waves' TTFT comes back as the
staggered requests' TPOT (benchmarks/sim_closed_loop.py measures both on a run's step costs).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from pagedkv.sched.request import Request


def resolve_mode(mode: str, on_cuda: bool) -> str:
    """The rule `mode` names: "auto" is "spread" on CPU and "fill" on a GPU, where a step's
    fixed cost is large against its prompt tokens' (spread's estimates,
    `prefill_step_overhead_tokens`, are a CPU step's; its gains measured on CPUs alone)."""
    if mode != "auto":
        return mode
    return "fill" if on_cuda else "spread"


@dataclass(frozen=True)
class PrefillBatching:
    """The rule ("fill" or "spread", resolved) and its cost estimates (`SchedulerOptions`'
    prefill_batching options)."""

    mode: str
    step_overhead_tokens: int
    decode_overhead_tokens: int

    @property
    def spreads(self) -> bool:
        return self.mode == "spread"

    def target_tokens(self, waiting: Sequence[Request], num_scheduled: int, budget: int) -> int:
        """The new prompt tokens this step should start: `sys.maxsize` under "fill" (the budget
        decides), else sqrt(queued prompt tokens x the step's overhead) with `num_scheduled`
        requests already in the step (its decodes and running chunks); at least 1, so the
        queue's head always starts when it fits. The queue is summed only until the target
        reaches `budget`."""
        if not self.spreads:
            return sys.maxsize
        overhead = self.step_overhead_tokens + num_scheduled * self.decode_overhead_tokens
        enough = budget * budget / overhead  # a queue this long fills the budget
        queued = 0
        for request in waiting:
            queued += request.num_tokens - request.num_computed_tokens
            if queued >= enough:
                return budget
        return max(math.isqrt(queued * overhead), 1)  # at least one prompt

    def holds_back(self, waiting: Sequence[Request], num_left: int, num_new: int,
                   next_room: int) -> bool:
        """Whether the queue's head (`waiting[0]`, `num_left` tokens to compute past its prefix
        hit), of which this step would take only `num_new`, waits for the next step instead:
        under "spread", when the next step's room for prompt tokens (`next_room`: its budget
        less the running requests' tokens, or the long-prefill cap) holds it and everything
        queued behind it (the next step is not full either way, so its first token comes no
        later, and this step ends sooner; a longer queue fills every step, and the chunk is
        then work the next step would lack room for). A head that only this step's running
        requests keep from fitting is never held: they take the next step's budget too."""
        if not (self.spreads and num_new < num_left <= next_room):
            return False
        queued = num_left
        for request in islice(waiting, 1, None):
            queued += request.num_tokens - request.num_computed_tokens
            if queued > next_room:
                return False
        return True
