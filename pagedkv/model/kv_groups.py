"""The runner's side of hybrid KV cache groups (kv/hybrid_spec.py, kv/coordinator.py).

With several groups a request has one block table per group, and a layer reads the KV tensor
slot its group gave it: `LayerGroups` maps each model layer to (group, slot) once, and per
step turns the step's sequences into one StepSequences per group (same tokens and lengths,
that group's tables and slots), whose metadata the layers of the group read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.model.backends.step import StepSequences
from pagedkv.sched.output import ScheduledRequest

T = TypeVar("T")


def slot_mapping(reqs: Sequence[ScheduledRequest], tables: Sequence[list[int]],
                 block_size: int) -> list[int]:
    """Cache slots of the step's tokens in batch order (decodes first, as `reqs` are)."""
    bs = block_size
    slots: list[int] = []
    for r, table in zip(reqs, tables, strict=True):
        start, seq_len = r.start_pos, r.start_pos + r.num_new_tokens
        for b in range(start // bs, (seq_len + bs - 1) // bs):
            base = table[b] * bs
            slots.extend(range(base + max(start - b * bs, 0), base + min(seq_len - b * bs, bs)))
    return slots


class LayerGroups:
    """Which KV cache group and tensor slot each model layer uses."""

    def __init__(self, spec: HybridKVCacheSpec) -> None:
        self.spec = spec
        self.num_groups = len(spec.groups)
        self.layer_slots = spec.layer_slots()

    def layer_caches(self, slot_caches: Sequence[T]) -> list[T]:
        """Each model layer's view of its slot, from the KV tensor's per-slot views (its (K, V)
        caches, or an int8 cache's per-token scales)."""
        return [slot_caches[slot] for _, slot in self.layer_slots]

    def group_steps(self, reqs: Sequence[ScheduledRequest], step: StepSequences
                    ) -> list[StepSequences]:
        """`step` once per group, with that group's block tables and slots. ValueError for a
        request without a table per group."""
        for r in reqs:
            if r.group_block_tables is None or len(r.group_block_tables) != self.num_groups:
                raise ValueError(f"request {r.request_id!r} has no block table per KV cache "
                                 f"group ({self.num_groups} groups)")
        out = []
        for g in range(self.num_groups):
            tables = [r.group_block_tables[g] for r in reqs]
            out.append(StepSequences(
                num_new_tokens=step.num_new_tokens, seq_lens=step.seq_lens, block_tables=tables,
                slot_mapping=slot_mapping(reqs, tables, step.block_size),
                num_decodes=step.num_decodes, block_size=step.block_size))
        return out

    def layer_metadata(self, group_metas: Sequence[object]) -> list[object]:
        """Each model layer's attention metadata: its group's."""
        return [group_metas[g] for g, _ in self.layer_slots]
