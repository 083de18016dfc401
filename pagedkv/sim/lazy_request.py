"""A scheduler `Request` whose prompt tokens are made when first read, not when it is queued.

The scheduler and the KV manager read a waiting request's tokens only once it reaches the head
of the waiting queue (its prefix lookup, allocation, scheduling); behind the head they read its
status, priority, arrival and length. So a simulated request waits holding only its trace row
(arrival, lengths, block ids) and makes its token lists (`traces.prompt_token_ids`, the same
lists the simulator passed before) on the first read of `prompt_token_ids` or
`all_token_ids`. An overloaded instance's queue of tens of thousands of long prompts then costs
a few KB per request instead of two prompt-long token lists each. The lists go with the request
when it finishes (the scheduler drops it; only the KV manager's bounded `recent_prompts` keeps
the last few prompts).
"""

from __future__ import annotations

from pagedkv.sched.request import Request
from pagedkv.sched.sampling_params import SamplingParams
from pagedkv.sim.traces import TraceRequest, prompt_token_ids

_TOKEN_LISTS = ("prompt_token_ids", "all_token_ids")


class LazyPromptRequest(Request):
    """A `Request` for trace row `trace_request` (prompt tokens from `prompt_token_ids(
    trace_request, vocab_size, unique_id)`), made when first read. Until then the two token
    lists are absent from the instance, so `__getattr__` (called only for absent attributes)
    makes them; afterwards they are plain attributes (no cost on the hot path)."""

    def __init__(self, request_id: str, trace_request: TraceRequest, vocab_size: int,
                 unique_id: int, sampling_params: SamplingParams, arrival_time: float) -> None:
        super().__init__(request_id=request_id, prompt_token_ids=(),
                         sampling_params=sampling_params, arrival_time=arrival_time)
        del self.prompt_token_ids, self.all_token_ids  # made on first read (__getattr__)
        self.num_prompt_tokens = trace_request.input_length
        self._recipe = (trace_request, vocab_size, unique_id)

    @property
    def is_materialized(self) -> bool:
        """Whether the token lists exist yet."""
        return "_recipe" not in self.__dict__

    def __getattr__(self, name: str) -> list[int]:
        """Make both token lists on the first read of either; sets them on the instance."""
        recipe = self.__dict__.pop("_recipe", None) if name in _TOKEN_LISTS else None
        if recipe is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        tokens = prompt_token_ids(*recipe)
        self.prompt_token_ids = tokens
        self.all_token_ids = list(tokens)
        return self.__dict__[name]

    @property
    def num_tokens(self) -> int:
        tokens = self.__dict__.get("all_token_ids")
        return self.num_prompt_tokens if tokens is None else len(tokens)
