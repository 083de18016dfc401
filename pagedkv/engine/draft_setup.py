"""Building the draft model of `speculative_config` method "draft_model": its ModelRunner and
its own KV manager, with as many blocks as the planner gave the target's cache (the budget
shared between both, draft_budget.py: every request the target holds has room for its draft
KV), and the proposer the Scheduler is given (engine/draft_proposer.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.draft_proposer import DraftModelProposer
from pagedkv.engine.executor import rank_cpu_threads
from pagedkv.kv.factory import make_kv_cache_manager
from pagedkv.spec import parse_speculative_config

if TYPE_CHECKING:
    from pagedkv.engine.kv_setup import KVCacheSetup

logger = logging.getLogger(__name__)


def check_draft_vocab(draft_dir: str, draft_vocab: int, target_dir: str,
                      target_vocab: int) -> None:
    """ValueError naming both models unless the draft's vocab is the target's."""
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_config.model {draft_dir!r} has vocab_size {draft_vocab}, "
                         f"the target {target_dir!r} has {target_vocab}: the draft must share "
                         "the target's tokenizer")


def build_draft_proposer(args: EngineArgs, setup: KVCacheSetup,
                         target_vocab: int) -> DraftModelProposer | None:
    """The draft-model proposer `args.speculative_config` asks for (None for any other
    method or none). ValueError for a missing draft directory or a different vocab."""
    from pagedkv.model.loader import check_model_dir
    from pagedkv.model.registry import model_config_from_dir
    from pagedkv.model.runner import ModelRunner

    spec = parse_speculative_config(args.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    try:
        check_model_dir(spec.model)
    except ValueError as e:
        raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from None
    check_draft_vocab(spec.model, model_config_from_dir(spec.model).vocab_size,
                      args.model, target_vocab)
    runner = ModelRunner(spec.model, block_size=args.block_size, num_blocks=setup.num_blocks,
                         dtype=args.dtype, device=args.device, seed=args.seed,
                         cpu_kernels=args.cpu_kernels, cpu_threads=rank_cpu_threads(args),
                         kv_cache_dtype=args.kv_cache_dtype)
    kv = make_kv_cache_manager(runner.kv_cache_spec, num_blocks=setup.num_blocks,
                               enable_caching=False)
    logger.info("draft model %s: %d KV blocks (%.1f MiB), target: %d blocks", spec.model,
                setup.num_blocks, setup.num_blocks * runner.kv_cache_spec.page_size_bytes / 2**20,
                setup.num_blocks)
    return DraftModelProposer(runner, kv, spec.num_speculative_tokens)
