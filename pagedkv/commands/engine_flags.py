"""Every `EngineArgs` field as a command-line flag, with vLLM's names, in one place.

`add_engine_flags(parser)` registers `--block-size`, `--dtype`, `--max-model-len`,
`--enable-prefix-caching/--no-enable-prefix-caching`, ... (one flag per field of
`EngineArgs` except `model`, which the commands take as MODEL_DIR or --model:
`add_model_argument` and `model_argument`), and
`engine_args_from_flags(args, model)` turns the parsed namespace back into `EngineArgs`.
`pagedkv serve` and `pagedkv generate` share both, so a new engine field shows up in both
commands without touching them. Flags left unset keep `EngineArgs`' defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any

from pagedkv.config.dtypes import KV_CACHE_DTYPE_CHOICES
from pagedkv.engine.args import _DTYPES, EngineArgs
from pagedkv.kernels.modes import CPU_KERNEL_MODES
from pagedkv.kv.eviction import EVICTION_POLICIES
from pagedkv.kv.sizes import parse_size

# Fields that the commands take otherwise (the positional MODEL_DIR).
_SKIPPED = ("model",)

_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": _DTYPES,
    "device": ("auto", "cpu", "cuda"),
    "preemption_mode": ("recompute", "swap"),
    "scheduling_policy": ("fcfs", "priority"),
    "prefix_caching_hash_algo": ("sha256", "xxhash"),
    "cpu_kernels": CPU_KERNEL_MODES,
    "eviction_policy": tuple(EVICTION_POLICIES),
    "kv_cache_dtype": KV_CACHE_DTYPE_CHOICES,
}

_HELP: dict[str, str] = {
    "tokenizer": "tokenizer directory (default: MODEL_DIR)",
    "revision": "with a Hugging Face model id: the branch, tag or commit (default: main)",
    "download_dir": "with a Hugging Face model id: the cache directory to look in and "
                    "download to (default: HF_HUB_CACHE, else HF_HOME/hub)",
    "dtype": "weights and KV cache dtype ('auto': the config's torch_dtype)",
    "device": "'auto' picks cuda when present, else cpu",
    "seed": "default random seed of the engine",
    "block_size": "tokens per KV cache block",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "prefix_caching_hash_algo": "hash of the prefix-cache block keys",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (longer prompts are chunked)",
    "max_model_len": "longest sequence, prompt plus output (default: the model's)",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "preemption_mode": "how a request gives its blocks back when memory runs out",
    "num_gpu_blocks_override": "number of device KV blocks (wins over the memory budget)",
    "kv_cache_memory_bytes": "device memory for the KV cache: bytes or a size like 2GiB",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use",
    "scheduling_policy": "'fcfs' or 'priority' (lower value first)",
    "watermark": "fraction of blocks kept free when admitting new requests",
    "kv_events_config": "publish KV cache events, a JSON object: enable_kv_cache_events, "
                        "publisher (zmq), endpoint, topic",
    "kv_offloading_size": "GiB of host RAM for the KV store's host tier (0: none)",
    "kv_offloading_disk_path": "directory of the KV store's disk tier (kept across restarts)",
    "kv_offloading_disk_size": "GiB the disk tier may use",
    "kv_offloading_remote_url": "Redis URL of the KV store's shared tier, e.g. redis://127.0.0.1:6379",
    "step_log": "append one JSON line per engine step (shape, seconds) to this file, for "
                "`pagedkv profile --fit-from`",
    "enforce_eager": "no CUDA graphs: run every decode step eagerly",
    "async_scheduling": "build the next step while the forward pass runs (same tokens)",
    "cpu_kernels": "CPU: fused C++ kernels; auto: build in the background on first use and "
                   "switch once built; wait: build before starting; off: pure torch",
    "cpu_threads": "CPU: compute threads (default: the cores other processes leave free, "
                   "re-read every second)",
    "eviction_policy": "which free cached KV block is evicted first: lru, lfu (fewest uses) "
                       "or arc (adaptive recency/frequency)",
    "max_pinned_fraction": "most of the KV cache that pinned prefixes (/v1/pin) may hold",
    "disable_hybrid_kv_cache_manager": "models mixing sliding-window and full layers: keep "
                                       "full-attention blocks on every layer (no KV cache groups)",
    "prefix_match_unit": "prefix hits in units of this many tokens (a divisor of block_size; "
                         "1: any token), reusing part of a cached block by copy-on-write",
    "kv_cache_dtype": "KV cache dtype: 'auto' (the model's), fp8 (= fp8_e4m3), fp8_e5m2 or "
                      "int8 (a scale per token and head): one byte per value, about twice "
                      "the blocks of bfloat16",
    "structured_outputs_max_choices": "structured outputs: most alternatives of a choice list",
    "structured_outputs_max_pattern_chars": "structured outputs: longest regex (characters)",
    "structured_outputs_max_grammar_chars": "structured outputs: longest grammar, or total "
                                            "characters of a choice list",
    "structured_outputs_max_schema_chars": "structured outputs: longest JSON schema (characters "
                                           "of compact JSON)",
    "structured_outputs_compile_timeout_s": "structured outputs: seconds a request waits for its "
                                            "constraint to compile (then a 400)",
    "structured_outputs_compile_threads": "structured outputs: threads of the grammar compile "
                                          "pool",
    "tensor_parallel_size": "split every layer over this many ranks (worker processes; "
                            "gloo on CPU, NCCL on CUDA)",
    "distributed_timeout_s": "tensor parallel: seconds a collective waits for the other ranks "
                             "before the engine fails (a rank died or hung)",
    "nnodes": "tensor parallel over several machines: how many (torchrun's --nnodes)",
    "node_rank": "this machine's index; 0 runs the engine, the others run only their ranks",
    "master_addr": "node 0's address, reachable from every machine (with --nnodes > 1)",
    "master_port": "a free port on node 0 for the ranks' rendezvous (with --nnodes > 1)",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, but '(default: X)' appears once: not again when the help
    text states it, and not for None (engine flags default to None, meaning 'not given')."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def _finite_float(text: str) -> float:
    """A float flag value; nan and infinities are refused (argparse names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0 (a flag value)."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _size(text: str) -> int:
    """A byte count: a plain number or a size such as '2GiB' (see pagedkv.kv.sizes)."""
    return parse_size(text)


# Fields whose values parse differently from their annotation.
_TYPES: dict[str, Any] = {"kv_cache_memory_bytes": _size}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> type:
    """`int | None` -> int, `float` -> float, ... (the one non-None type of the annotation)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if base not in (int, float, str, bool):
        raise TypeError(f"EngineArgs field type {annotation!r} has no command-line form")
    return base


def _optional_int(text: str) -> int | None:
    """Parse an int flag value; 'none' means None (for fields whose default is None)."""
    return None if text.lower() == "none" else int(text)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The model directory: positional (`pagedkv serve MODEL_DIR`) or `--model MODEL_DIR`,
    both accepted as vLLM's `vllm serve` does; `model_argument(args)` reads it."""
    parser.add_argument("model", metavar="MODEL_DIR", nargs="?", default=None,
                        help="model directory, .gguf file or Hugging Face id (org/name); "
                        "or --model MODEL_DIR")
    parser.add_argument("--model", dest="model_option", metavar="MODEL_DIR", default=None,
                        help="the model directory, as the positional MODEL_DIR")


def model_argument(args: argparse.Namespace) -> str:
    """The model directory given positionally or as --model (ValueError when neither is given,
    or both and they differ)."""
    positional, option = args.model, getattr(args, "model_option", None)
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"the model is given twice: {positional!r} and --model {option!r}")
    model = positional if positional is not None else option
    if not model:
        command = getattr(args, "command", None) or "serve"
        raise ValueError(f"no model given: pagedkv {command} MODEL_DIR (or --model MODEL_DIR)")
    return model


def add_engine_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per `EngineArgs` field (but `model`) to `parser`, in an 'engine' group.

    Every flag's argparse default is None (meaning 'not given'); `engine_args_from_flags`
    fills in `EngineArgs`' own defaults, so they live in one place.
    """
    group = parser.add_argument_group("engine", "EngineArgs, with vLLM's flag names")
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        if field.name in _SKIPPED:
            continue
        base = _base_type(hints[field.name])
        default = field.default
        help_text = _HELP.get(field.name, field.name.replace("_", " "))
        if default is not None:
            help_text = f"{help_text} (default: {default})"
        help_text = help_text.replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": field.name, "default": None, "help": help_text}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _TYPES.get(field.name) or (
                _optional_int if base is int and default is None
                else _finite_float if base is float else base)
            kwargs["metavar"] = field.name.upper() if field.name not in _CHOICES else None
            if field.name in _CHOICES:
                kwargs["choices"] = _CHOICES[field.name]
        group.add_argument(_flag(field.name), **kwargs)
    return parser


def engine_args_from_flags(args: argparse.Namespace, model: str) -> EngineArgs:
    """`EngineArgs` for `model` from the flags given on the command line (the rest default).

    Raises ValueError (naming the field) when a value is out of range.
    """
    given = {}
    for name in EngineArgs.field_names():
        if name in _SKIPPED:
            continue
        value = getattr(args, name, None)
        if value is not None:
            given[name] = value
    return EngineArgs(model=model, **given)
