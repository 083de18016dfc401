"""KV cache groups for models that mix attention types (vLLM's hybrid KV cache layout).

Gemma 2 alternates sliding-window and full-attention layers, Gemma 3 has five sliding layers
per full one, Qwen2 with `max_window_layers` slides only its upper layers. Keeping full-attention
blocks on every layer wastes the sliding layers' memory, so the layers are split into KV cache
groups, each with its own block tables over ONE shared block pool:

- layers are grouped by attention type (full, or sliding with a given window);
- every group has the same number of layers, `group_size` (so every pool block has the same
  size in bytes in every group: `block_size * group_size * 2 * kv_heads * head_size * dtype`);
- `group_size` is vLLM's rule: the layer count of the rarest type, or the largest one when
  no type has more than 1.25x the rarest's (few groups, little padding); a type with `n`
  layers then fills `cdiv(n, group_size)` groups, the last one padded with unused slots.

Gemma 3 (26 layers, 22 sliding + 4 full): group_size 4, one full group and six sliding
groups. A pool block is one [group_size, 2, kv_heads, block_size, head_dim] slab of the KV
tensor; layer `layer_ids[j]` of a group reads slot `j` of the blocks in that group's table.
At 32k tokens (block 16) a sequence holds 2,048 blocks in the full group and 65 per sliding
group (the window's), against 6 x 2,048 blocks of the same size when every layer keeps all.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from pagedkv.kv.spec import FullAttentionSpec, SlidingWindowSpec
from pagedkv.utils import cdiv


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: its attention type's spec (`num_layers` = the group size, so its
    `page_size_bytes` is the pool's block size in bytes) and the model layers it serves, in
    slot order (fewer than the group size when padded)."""

    group_idx: int
    spec: FullAttentionSpec
    layer_ids: tuple[int, ...]

    @property
    def sliding_window(self) -> int | None:
        return self.spec.sliding_window if isinstance(self.spec, SlidingWindowSpec) else None


@dataclass(frozen=True)
class HybridKVCacheSpec(FullAttentionSpec):
    """The KV cache of a model whose layers mix attention types: `groups` over one pool.

    As a FullAttentionSpec it describes the KV tensor: `num_layers` is the group size (slots
    per block), so `page_size_bytes` is one pool block. `bytes_per_token` counts every slot
    of every group (padding included); `max_blocks_per_seq` sums the groups'.
    """

    groups: tuple[KVCacheGroupSpec, ...] = ()
    num_model_layers: int = 0

    kind = "hybrid"

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.groups) < 2:
            raise ValueError(f"a hybrid KV cache spec needs at least 2 groups, got "
                             f"{len(self.groups)}")

    @property
    def bytes_per_token(self) -> int:
        return len(self.groups) * super().bytes_per_token

    @property
    def page_size_bytes(self) -> int:
        """One pool block: block_size tokens of group_size layers."""
        return self.block_size * super().bytes_per_token

    def max_blocks_per_seq(self, max_model_len: int) -> int:
        return sum(g.spec.max_blocks_per_seq(max_model_len) for g in self.groups)

    def all_layers_spec(self, dtype: str | None = None) -> FullAttentionSpec:
        """The one-group layout of the same model: every model layer in its own slot of a
        full-attention block (KV cache dtype `dtype`, default this spec's)."""
        return FullAttentionSpec(block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                                 head_size=self.head_size, dtype=dtype or self.dtype,
                                 num_layers=self.num_model_layers)

    def layer_slots(self) -> list[tuple[int, int]]:
        """(group index, slot) of every model layer, in layer order."""
        out: list[tuple[int, int] | None] = [None] * self.num_model_layers
        for g in self.groups:
            for slot, layer in enumerate(g.layer_ids):
                out[layer] = (g.group_idx, slot)
        return out  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in super().to_dict().items() if k != "groups"}
        out["groups"] = [{"group_idx": g.group_idx, "kind": g.spec.kind,
                          "sliding_window": g.sliding_window, "layer_ids": list(g.layer_ids)}
                         for g in self.groups]
        return out


def uniform_group_size(layer_counts: list[int]) -> int:
    """Layers per group given each attention type's layer count (vLLM's rule, module doc)."""
    smallest, largest = min(layer_counts), max(layer_counts)
    return largest if largest < smallest * 1.25 else smallest


def hybrid_kv_cache_spec(layer_windows: tuple[int | None, ...], *, block_size: int,
                         num_kv_heads: int, head_size: int,
                         dtype: str) -> HybridKVCacheSpec | None:
    """The grouped spec of a model with these per-layer windows (None: full attention), or
    None when every layer has the same type (one group: the plain spec serves it)."""
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_type.setdefault(window, []).append(layer)
    if len(by_type) < 2:
        return None
    group_size = uniform_group_size([len(v) for v in by_type.values()])
    shape = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                 dtype=dtype, num_layers=group_size)
    groups: list[KVCacheGroupSpec] = []
    # Full attention first (group 0: its hashes are the request's, see coordinator.py), then
    # sliding types by window.
    for window in sorted(by_type, key=lambda w: (w is not None, w or 0)):
        layers = by_type[window]
        spec = (FullAttentionSpec(**shape) if window is None
                else SlidingWindowSpec(**shape, sliding_window=window))
        for i in range(cdiv(len(layers), group_size)):
            groups.append(KVCacheGroupSpec(len(groups), spec,
                                           tuple(layers[i * group_size:(i + 1) * group_size])))
    return HybridKVCacheSpec(**shape, groups=tuple(groups), num_model_layers=len(layer_windows))


def group_summary(spec: HybridKVCacheSpec) -> Counter[str]:
    """How many groups of each kind ("full_attention", "sliding_window")."""
    return Counter(g.spec.kind for g in spec.groups)


def sequence_capacity(spec: FullAttentionSpec, num_usable_blocks: int) -> int:
    """Tokens one sequence can hold in `num_usable_blocks` blocks: all of them for a plain
    spec; with KV cache groups, the blocks the sliding groups keep resident (their windows')
    are set aside and the rest shared by the full-attention groups (no full group: no bound
    but the pool's, returned as usable blocks x block size x groups)."""
    bs = spec.block_size
    if not isinstance(spec, HybridKVCacheSpec):
        return num_usable_blocks * bs
    full = [g for g in spec.groups if g.sliding_window is None]
    resident = sum(cdiv(g.sliding_window, bs) + 1 for g in spec.groups
                   if g.sliding_window is not None)
    if not full:
        return num_usable_blocks * bs * len(spec.groups)
    return max(num_usable_blocks - resident, 0) // len(full) * bs
