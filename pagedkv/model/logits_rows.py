"""Which positions of a step get logits, and what each row of those logits is for.

Most steps need one row per sampling request (its last scheduled position). A request that
asked for prompt logprobs also needs the logits of the leading `num_prompt_logprob_rows`
positions of its chunk (position p scores prompt token p + 1); those rows are computed only in
the prefill chunks that cover such positions. A request verifying speculative draft tokens
needs the logits of every position it runs (its last token's and each draft's: k + 1 rows).
Positions come out strictly increasing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.sched.output import ScheduledRequest


@dataclass
class PromptLogprobRows:
    """`count` logits rows starting at `first_row`, scoring `target_ids` (the next prompt tokens)."""

    request: ScheduledRequest
    first_row: int
    count: int

    @property
    def target_ids(self) -> list[int]:
        start = self.request.start_pos + 1
        return self.request.prompt_token_ids[start:start + self.count]


@dataclass
class LogitsSelection:
    """`positions`: flat token positions of the step whose logits are computed, in row order.
    `samplers[i]` samples from logits row `sample_rows[i]`; `verifiers[i]` verifies its draft
    tokens with the rows listed for it in `verify_rows` (its k + 1 rows, in order)."""

    positions: list[int] = field(default_factory=list)
    samplers: list[ScheduledRequest] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    verifiers: list[ScheduledRequest] = field(default_factory=list)
    verify_rows: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.positions

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of `hidden` [T, H] at `positions` (`hidden` itself when that is all of it)."""
        if len(self.positions) == hidden.shape[0]:  # positions are strictly increasing
            return hidden
        return hidden[torch.tensor(self.positions, device=hidden.device)]

    def sample_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling requests' rows of `logits` (`logits` itself when no other rows exist)."""
        if len(self.sample_rows) == logits.shape[0]:
            return logits
        return logits[torch.tensor(self.sample_rows, device=logits.device)]

    def verify_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The verifying requests' rows of `logits`, each request's k + 1 rows in turn."""
        if len(self.verify_rows) == logits.shape[0]:
            return logits
        return logits[torch.tensor(self.verify_rows, device=logits.device)]


def select_logits_rows(reqs: list[ScheduledRequest]) -> LogitsSelection:
    """The logits rows of a step whose flattened tokens are `reqs`' tokens in this order."""
    sel = LogitsSelection()
    offset = 0
    for r in reqs:
        if r.num_prompt_logprob_rows > 0:
            sel.prompt_rows.append(PromptLogprobRows(r, len(sel.positions),
                                                     r.num_prompt_logprob_rows))
            sel.positions.extend(range(offset, offset + r.num_prompt_logprob_rows))
        if r.spec_token_ids:  # every position: the last token's and each draft's
            sel.verify_rows.extend(range(len(sel.positions),
                                         len(sel.positions) + r.num_new_tokens))
            sel.positions.extend(range(offset, offset + r.num_new_tokens))
            sel.verifiers.append(r)
        elif r.num_samples > 0:  # its last position (prompt-logprob rows end before it)
            sel.sample_rows.append(len(sel.positions))
            sel.positions.append(offset + r.num_new_tokens - 1)
            sel.samplers.append(r)
        offset += r.num_new_tokens
    return sel
