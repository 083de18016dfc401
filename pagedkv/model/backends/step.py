"""StepSequences: the backend-neutral description of one step's attention inputs.

The runner builds it from the scheduled requests (host lists, decodes first) and hands it to the
attention backend chosen for the device (backends/__init__.py), which turns it into its own
metadata object, the one every layer's attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepSequences:
    """The step's sequences in batch order, the `num_decodes` single-token decodes first.

    Sequence i contributes `num_new_tokens[i]` consecutive tokens of the flattened batch, its
    positions seq_lens[i] - num_new_tokens[i] .. seq_lens[i] - 1, and its K/V for positions
    0 .. seq_lens[i] - 1 live in the blocks `block_tables[i]` (at least the blocks those positions
    need). `slot_mapping[t]` is the cache slot of token t of the batch.
    """

    num_new_tokens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    num_decodes: int
    block_size: int
