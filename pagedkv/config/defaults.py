"""Engine defaults that more than one package reads (the planner, the engine, the scheduler)."""

# Per-step token budget when max_num_batched_tokens is not given: `pagedkv plan` estimates the
# activation peak with it and the engine schedules with it, so both size the same cache.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256
