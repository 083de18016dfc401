"""`pagedkv plan`: how many KV cache blocks (and sequences) a memory budget holds for a model.

    pagedkv plan --config CONFIG_JSON_OR_MODEL_DIR --memory 80GiB [--utilization 0.9]
                 [--block-size 16] [--dtype bfloat16] [--kv-cache-dtype fp8]
                 [--max-model-len N] [--swap-space 4GiB]
                 [--weights-bytes N] [--kv-offloading-size SIZE]
                 [--kv-offloading-disk-size SIZE] [--json]

Sizes take binary units (GiB, G = 2**30) or decimal ones (GB = 10**9); see pagedkv.kv.sizes.
`--dtype` is the model's dtype, used for the weights and activation estimates and, unless
`--kv-cache-dtype` says otherwise, the KV cache ("auto": the config's torch_dtype);
`--kv-cache-dtype fp8` (or fp8_e4m3, fp8_e5m2) halves the bytes per block against bfloat16, so
the same budget holds twice the blocks. Needs no torch and no weights: only the config.json.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pagedkv.commands.engine_flags import add_option_flags
from pagedkv.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from pagedkv.config.options import CacheOptions, ModelOptions
from pagedkv.kv.group_plan import group_rows
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.pins import max_pinned_blocks
from pagedkv.kv.plan import (
    KVCachePlan,
    default_max_model_len,
    estimate_activation_peak_bytes,
    estimate_weights_bytes,
    plan_num_blocks,
)
from pagedkv.kv.sizes import format_size, parse_size
from pagedkv.kv.spec import bundled_config_names, bundled_config_path
from pagedkv.model.config_files import load_hf_config
from pagedkv.store.sizing import disk_tier_blocks, host_tier_blocks

DEFAULT_SWAP_SPACE = "4GiB"
# The engine options the plan reads as the engine does (its memory sizes are byte sizes, and its
# --dtype an estimate's, so those stay its own flags).
PLANNED_OPTIONS = ("block_size", "kv_cache_dtype", "max_model_len", "eviction_policy",
                   "max_pinned_fraction")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `plan` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "plan",
        help="KV cache capacity for a model config and a memory budget",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--config", required=True, metavar="CONFIG_JSON_OR_MODEL_DIR",
                        help="a Hugging Face config.json, a model directory holding one, or "
                        "the name of a bundled example (" + ", ".join(bundled_config_names()) + ")")
    parser.add_argument("--memory", required=True, metavar="SIZE",
                        help="device memory budget, e.g. 80GiB (2**30) or 80GB (10**9)")
    parser.add_argument("--utilization", type=float, default=0.9,
                        help="fraction of --memory the engine may use (default 0.9)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, float16, fp8 or auto (the config's torch_dtype)")
    parser.add_argument("--swap-space", default=DEFAULT_SWAP_SPACE, metavar="SIZE",
                        help=f"host memory for swapped-out blocks (default {DEFAULT_SWAP_SPACE})")
    parser.add_argument("--weights-bytes", default=None, metavar="N",
                        help="model weights size (default: estimated from the config)")
    parser.add_argument("--kv-offloading-size", default="0", metavar="SIZE",
                        help="host RAM of the KV store's host tier (default 0: none)")
    parser.add_argument("--kv-offloading-disk-size", default="0", metavar="SIZE",
                        help="disk space of the KV store's disk tier (default 0: none)")
    add_option_flags(parser, CacheOptions, ModelOptions, only=PLANNED_OPTIONS)
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.set_defaults(run=run)
    return parser


def _config_path(config: str) -> str:
    """A path as given, or the bundled example config of that name when no such path exists."""
    if not os.path.exists(config) and config in bundled_config_names():
        return bundled_config_path(config)
    return config


def make_plan(args: argparse.Namespace) -> tuple[KVCachePlan, dict[str, Any]]:
    """Build the plan the arguments describe; returns it and the extra facts shown with it."""
    memory = parse_size(args.memory, name="--memory")
    swap = parse_size(args.swap_space, name="--swap-space")
    config = load_hf_config(_config_path(args.config))
    spec = kv_cache_spec_from_hf_config(config, block_size=args.block_size, dtype=args.dtype,
                                        cache_dtype=args.kv_cache_dtype)
    if args.weights_bytes is None:
        weights = estimate_weights_bytes(config, args.dtype)
        weights_source = "estimated from config"
    else:
        weights = parse_size(args.weights_bytes, name="--weights-bytes")
        weights_source = "given"
    activation = estimate_activation_peak_bytes(config, DEFAULT_MAX_NUM_BATCHED_TOKENS, args.dtype)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = default_max_model_len(config)
    elif max_model_len <= 0:
        raise ValueError(f"--max-model-len must be a positive integer, got {max_model_len}")
    plan = plan_num_blocks(
        spec,
        memory_bytes=memory,
        utilization=args.utilization,
        weights_bytes=weights,
        activation_peak_bytes=activation,
        swap_space_bytes=swap,
        max_model_len=max_model_len,
    )
    host_tier = parse_size(args.kv_offloading_size, name="--kv-offloading-size")
    disk_tier = parse_size(args.kv_offloading_disk_size, name="--kv-offloading-disk-size")
    extra = {
        "host_tier_blocks": host_tier_blocks(host_tier, plan.bytes_per_block),
        "disk_tier_blocks": disk_tier_blocks(disk_tier, plan.bytes_per_block),
        "config": args.config,
        "model_type": config.get("model_type"),
        "weights_source": weights_source,
        "activation_max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "eviction_policy": args.eviction_policy,
        "max_pinned_blocks": max_pinned_blocks(args.max_pinned_fraction,
                                               max(plan.num_blocks - 1, 0)),
    }
    extra.update(group_rows(spec, max_model_len) or {})
    return plan, extra


def format_table(plan: KVCachePlan, extra: dict[str, Any]) -> str:
    """The human-readable, aligned table `pagedkv plan` prints."""
    spec = plan.spec
    if spec.kind == "mla":
        layout = (f"{spec.num_layers} layers x (kv_lora_rank {spec.kv_lora_rank} + "
                  f"qk_rope_head_dim {spec.qk_rope_head_dim}) x {spec.dtype}")
    else:
        layout = (f"{spec.num_layers} layers x 2 (K,V) x {spec.num_kv_heads} kv heads x "
                  f"{spec.head_size} head size x {spec.dtype}")
    kind = spec.kind + (f" (window {spec.sliding_window})" if spec.kind == "sliding_window" else "")
    rows = [
        ("config", f"{extra['config']} ({extra['model_type']})"),
        ("kv cache", kind),
        ("layout", layout),
        ("bytes per token", f"{plan.bytes_per_token:,} ({format_size(plan.bytes_per_token)})"),
        ("block size", f"{spec.block_size} tokens"),
        ("bytes per block", f"{plan.bytes_per_block:,} ({format_size(plan.bytes_per_block)})"),
        ("memory budget", f"{format_size(plan.memory_bytes)} x {plan.utilization:g} utilization"),
        ("weights", f"{format_size(plan.weights_bytes)} ({extra['weights_source']})"),
        ("activation peak", f"{format_size(plan.activation_peak_bytes)} (estimated, "
                            f"{extra['activation_max_num_batched_tokens']} batched tokens)"),
        ("kv cache memory", format_size(plan.kv_cache_bytes)),
        ("device blocks", f"{plan.num_blocks:,}"),
        ("max cached tokens", f"{plan.max_cached_tokens:,}"),
        ("max model len", f"{plan.max_model_len:,} tokens = {plan.max_blocks_per_seq:,} "
                          + ("resident blocks per sequence (window)" if spec.kind == "sliding_window"
                             else "blocks per sequence")),
        ("max concurrent seqs", f"{plan.max_concurrent_seqs:,} at max model len"),
        ("swap space", format_size(plan.swap_space_bytes)),
        ("host (swap) blocks", f"{plan.num_host_blocks:,}"),
        ("store host blocks", f"{extra['host_tier_blocks']:,}"),
        ("store disk blocks", f"{extra['disk_tier_blocks']:,} (Redis: bounded by the server)"),
        ("eviction policy", extra["eviction_policy"]),
        ("max pinned blocks", f"{extra['max_pinned_blocks']:,}"),
    ]
    for g in extra.get("kv_cache_groups", ()):
        window = f" (window {g['sliding_window']})" if g["sliding_window"] else ""
        rows.append((f"group {g['group_idx']}", f"{g['kind']}{window}, layers {g['layers']}: "
                     f"{g['blocks_per_seq']:,} blocks = {format_size(g['bytes_per_seq'])} "
                     "per sequence"))
    if "kv_bytes_per_seq" in extra:
        rows.append(("kv bytes per seq", f"{format_size(extra['kv_bytes_per_seq'])} at max model "
                     f"len; all layers full: {format_size(extra['all_full_kv_bytes_per_seq'])} "
                     f"({extra['saving_vs_all_full']}x more)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def run(args: argparse.Namespace) -> int:
    """Print the plan (table or JSON). Errors are ValueError/OSError for the CLI to report."""
    plan, extra = make_plan(args)
    if args.json:
        print(json.dumps({**plan.to_dict(), **extra}, indent=2))
    else:
        print(format_table(plan, extra))
    return 0
