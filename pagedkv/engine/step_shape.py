"""StepShape: what one engine step computes, read from the scheduler's batch (no torch):
prefill tokens and their attention context, decode sequences and their context, the blocks
swapped and saved. The engine's step log writes it; the simulator's latency models take it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.sched.output import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes.

    `prefill_tokens`: tokens of chunks longer than one token (prompt chunks, recompute);
    `prefill_attention`: sum over those chunks of tokens x mean context (attention work);
    `prefill_past`: the part of it against KV already cached before the chunk (tokens x start
    position: a later chunk of a long prompt, a prefix hit), which takes another attention
    path than the chunk's own causal part;
    `decode_seqs` / `decode_context`: one-token chunks and the sum of their context lengths;
    `swapped_blocks`: blocks copied between device and host; `saved_blocks`: full blocks
    copied out to the KV store (its connector metadata's `num_saves`).
    """

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attention: float = 0.0
    decode_seqs: int = 0
    decode_context: int = 0
    swapped_blocks: int = 0
    saved_blocks: int = 0
    prefill_past: float = 0.0

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        prefill_tokens = prefill_seqs = decode_seqs = decode_context = 0
        prefill_attention = prefill_past = 0.0
        for s in out.scheduled:
            n = len(s.token_ids)
            if n == 1:
                decode_seqs += 1
                decode_context += s.start_pos + 1
            else:
                prefill_seqs += 1
                prefill_tokens += n
                prefill_attention += n * (s.start_pos + (n + 1) / 2)
                prefill_past += n * s.start_pos
        meta = out.kv_connector_metadata
        return cls(prefill_tokens, prefill_seqs, prefill_attention, decode_seqs, decode_context,
                   len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in),
                   meta.num_saves if meta is not None else 0, prefill_past)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def features(self) -> list[float]:
        """The fitted model's regressors, in `FEATURE_NAMES` order."""
        return [1.0, float(self.prefill_tokens), float(self.prefill_seqs), self.prefill_attention,
                float(self.decode_seqs), float(self.decode_context), float(self.swapped_blocks),
                float(self.saved_blocks), self.prefill_past]


FEATURE_NAMES = ("intercept", "prefill_tokens", "prefill_seqs", "prefill_attention",
                 "decode_seqs", "decode_context", "swapped_blocks", "saved_blocks",
                 "prefill_past")
