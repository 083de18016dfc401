"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

- Attention: the query heads are split evenly; the KV heads too when there are at least as many
  as ranks, else each rank keeps the one KV head its query heads read (replicated).
- qkv and gate/up projections are column-parallel (each rank computes its heads' / its slice of
  the intermediate's outputs); o_proj and down_proj are row-parallel (each rank multiplies its
  input slice; the partial sums are all-reduced, once after attention and once after the MLP).
  A row-parallel bias is added by rank 0 only (zeros elsewhere), so the sum has it once.
- Embedding and LM head are vocabulary-parallel: rank r holds rows [r * V', (r + 1) * V') of a
  vocabulary padded to size * V' (padding rows zero; padded logits are cut off after the gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.kv.shard import local_kv_heads

if TYPE_CHECKING:
    from pagedkv.model.config import ModelConfig
    from pagedkv.model.parallel.group import TensorParallelGroup


@dataclass(frozen=True)
class TensorParallelShape:
    """Rank `rank` of `size`: its share of a model with `num_heads` query heads, `num_kv_heads`
    KV heads, an MLP of `intermediate_size` and a vocabulary of `vocab_size`."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        check_tensor_parallel_size(self.size, self.num_heads, self.num_kv_heads,
                                   self.intermediate_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return local_kv_heads(self.num_kv_heads, self.size)

    @property
    def first_head(self) -> int:
        return self.rank * self.local_heads

    @property
    def first_kv_head(self) -> int:
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        return self.rank * self.num_kv_heads // self.size  # the KV head its query heads read

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def local_vocab(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def first_vocab(self) -> int:
        return self.rank * self.local_vocab


def model_shard(tp: TensorParallelGroup | None, cfg: ModelConfig) -> TensorParallelShape | None:
    """Rank `tp.rank`'s share of the model `cfg` describes; None without tensor parallelism
    (no group, or a group of one)."""
    if tp is None or tp.size == 1:
        return None
    return TensorParallelShape(tp.rank, tp.size, cfg.num_heads, cfg.num_kv_heads,
                               cfg.intermediate_size, cfg.vocab_size)


def check_tensor_parallel_size(size: int, num_heads: int, num_kv_heads: int,
                               intermediate_size: int) -> None:
    """ValueError naming the value when the model cannot be split over `size` ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                         f"{num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and the model's {num_kv_heads} KV heads: "
                         "one must divide the other")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's "
                         f"intermediate_size {intermediate_size}")


@dataclass(frozen=True)
class Shard:
    """Rows [start, stop) of dim `dim` of a checkpoint tensor; `zero`: a tensor of that slice's
    shape filled with zeros instead (a row-parallel bias on ranks other than 0)."""

    dim: int
    start: int
    stop: int
    zero: bool = False


def checkpoint_shards(param_name: str, sh: TensorParallelShape | None,
                      cfg: ModelConfig) -> list[Shard | None] | None:
    """Which slice of each of `param_name`'s checkpoint tensors rank `sh.rank` loads (None:
    the whole tensor), for a model of fused `qkv_proj` / `gate_up_proj`, row-parallel `o_proj`
    / `down_proj` and a vocabulary-parallel `embed_tokens` / `lm_head` (every registered
    architecture); None for the whole model (`sh` None)."""
    if sh is None:
        return None
    d = cfg.head_dim
    if param_name in ("embed_tokens.weight", "lm_head.weight"):
        return [Shard(0, sh.first_vocab, min(sh.first_vocab + sh.local_vocab, cfg.vocab_size))]
    q = Shard(0, sh.first_head * d, (sh.first_head + sh.local_heads) * d)
    kv = Shard(0, sh.first_kv_head * d, (sh.first_kv_head + sh.local_kv_heads) * d)
    mlp = Shard(0, sh.rank * sh.local_intermediate, (sh.rank + 1) * sh.local_intermediate)
    if ".qkv_proj." in param_name:
        return [q, kv, kv]
    if ".gate_up_proj." in param_name:
        return [mlp, mlp]
    if param_name.endswith("o_proj.weight"):
        return [Shard(1, q.start, q.stop)]
    if param_name.endswith("down_proj.weight"):
        return [Shard(1, mlp.start, mlp.stop)]
    if param_name.endswith(("o_proj.bias", "down_proj.bias")):  # added once, by rank 0
        return [Shard(0, 0, cfg.hidden_size, zero=sh.rank != 0)]
    return [None]
