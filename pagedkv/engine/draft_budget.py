"""What a draft model (`speculative_config` method "draft_model") takes of the KV cache
budget: the planner (kv_setup.py) gives the target's cache and the draft's the same number of
blocks (a request the target holds has room for its draft KV), so a budget in bytes buys blocks
of both pages together; on CUDA the draft's weights come off the budget too. Read from the
draft's config alone, before any weight is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedkv.engine.args import EngineArgs
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.plan import estimate_weights_bytes
from pagedkv.model.config_files import load_hf_config
from pagedkv.spec import parse_speculative_config


@dataclass(frozen=True)
class DraftBudget:
    """One draft KV block's bytes and the draft's weights' bytes (both 0 without a draft)."""

    page_bytes: int = 0
    weights_bytes: int = 0


def draft_budget(args: EngineArgs) -> DraftBudget:
    """The draft model's share of the budget `args` configure (zeros without one).
    ValueError naming the directory when it does not exist."""
    spec = parse_speculative_config(args.speculative_config)
    if spec is None or spec.method != "draft_model":
        return DraftBudget()
    if not Path(spec.model).exists():
        raise ValueError(f"speculative_config.model {spec.model!r}: model directory not found")
    config = load_hf_config(spec.model)
    page = kv_cache_spec_from_hf_config(config, args.block_size, args.dtype,
                                        args.kv_cache_dtype).page_size_bytes
    return DraftBudget(page_bytes=page, weights_bytes=estimate_weights_bytes(config, args.dtype))
