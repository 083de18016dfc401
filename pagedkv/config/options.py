"""Every engine option, declared once: its type, default, help, range and choices.

Each option is one field of a typed group (`CacheOptions`, `SchedulerOptions`, ...) written with
`opt(default, help, ...)`; the field's metadata carries the help text, the range (`ge`, `gt`,
`le`, `lt`), the choices (a `Literal` annotation, or `choices=` for a list kept elsewhere) and how
a command-line value parses (`parse=`). `EngineArgs` (pagedkv/engine/args.py) inherits every
group and stays flat (vLLM's names); from the same declarations come

- validation: `check_options(obj)` checks each declared field's type, range and choices, with a
  `ValueError` naming the field, its value and the limit (only rules across fields stay
  hand-written, in `EngineArgs.validate`);
- every command's engine flags (`pagedkv.commands.engine_flags.add_option_flags`);
- the reference page docs/usage/engine-args.md (`python -m pagedkv.commands.options_doc`).

A new knob is one `opt(...)` line in its group plus the code that reads it. Torch-free, and it
imports nothing above `pagedkv.config`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedkv.config.defaults import DEFAULT_MAX_NUM_SEQS
from pagedkv.config.dtypes import KV_CACHE_DTYPE_CHOICES, MODEL_DTYPE_CHOICES
from pagedkv.config.sizes import parse_size

# The `quantization` option's values (pagedkv.model.quant.apply reads each).
QUANTIZATION_CHOICES = ("auto", "none", "int8", "gptq", "awq")

PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fcfs", "priority"]
PrefixCachingHashAlgo = Literal["sha256", "xxhash"]
Device = Literal["auto", "cpu", "cuda"]
ExecutorBackend = Literal["mp", "ray"]
# pagedkv.kernels.modes.CPU_KERNEL_MODES is read from this; the eviction policies' names are
# those of pagedkv.kv.eviction.EVICTION_POLICIES (tests/config/test_options.py holds them equal).
CpuKernelMode = Literal["auto", "wait", "off"]
CpuMalloc = Literal["auto", "glibc"]
EvictionPolicyName = Literal["lru", "lfu", "arc"]
PrefillBatching = Literal["auto", "fill", "spread"]


def opt(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,  # noqa: A002
        le: float | None = None, lt: float | None = None,
        choices: tuple[str, ...] | None = None, parse: Callable[[str], Any] | None = None,
        nonempty: bool = False, flag: bool = True, kw_only: bool = True) -> Any:
    """A dataclass field declaring one engine option.

    `ge`/`gt`/`le`/`lt`: the range (inclusive / exclusive bounds); `choices`: the values a
    `str` option takes (a `Literal` annotation says the same inline); `parse`: how a
    command-line string becomes the value (default: from the annotation); `nonempty`: a
    string option given must not be empty; `flag=False`: no command-line flag (the commands
    take it otherwise); `kw_only=False`: positional, as `EngineArgs(model)`.
    """
    return field(default=default, kw_only=kw_only, metadata={
        "help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices,
        "parse": parse, "nonempty": nonempty, "flag": flag})


@dataclass(kw_only=True)
class ModelOptions:
    """Which model, its weights' dtype and the longest sequence."""

    model: str = opt("", "the model: a directory, .gguf file or Hugging Face id", flag=False,
                     kw_only=False)
    tokenizer: str | None = opt(None, "tokenizer directory (default: MODEL_DIR)")
    revision: str | None = opt(None, "with a Hugging Face model id: the branch, tag or commit "
                               "(default: main)")
    download_dir: str | None = opt(None, "with a Hugging Face model id: the cache directory to "
                                   "look in and download to (default: HF_HUB_CACHE, else "
                                   "HF_HOME/hub)")
    dtype: str = opt("auto", "weights and KV cache dtype ('auto': the config's torch_dtype; "
                     "a GGUF file's float type, bfloat16 when it is quantized)",
                     choices=MODEL_DTYPE_CHOICES)
    seed: int = opt(0, "default random seed of the engine")
    quantization: str = opt(
        "auto", "CPU weights: auto (with a 16-bit dtype, a GGUF file's Q4_0/Q4_1/Q4_K, "
        "Q5_0/Q5_1/Q5_K, Q8_0, Q6_K, Q3_K, IQ4_NL and IQ4_XS linears, embedding table and LM "
        "head, and a GPTQ or AWQ checkpoint's 4-bit linears, stay packed "
        "and are computed on packed; on a GPU they are dequantized), gptq / awq (auto, for a "
        "checkpoint of that method), none (every weight "
        "dequantized to dtype), int8 (every other linear int8 per output channel; CPU only)",
        choices=QUANTIZATION_CHOICES)
    max_model_len: int | None = opt(None, "longest sequence, prompt plus output (default: the "
                                    "model's)", ge=1)


@dataclass(kw_only=True)
class CacheOptions:
    """The KV cache: its blocks, their number and dtype, prefix caching and eviction."""

    block_size: int = opt(16, "tokens per KV cache block", ge=1)
    enable_prefix_caching: bool = opt(True, "reuse the KV blocks of shared prompt prefixes")
    prefix_caching_hash_algo: PrefixCachingHashAlgo = opt(
        "sha256", "hash of the prefix-cache block keys")
    swap_space: float = opt(4.0, "GiB of host memory for swapped-out KV blocks", ge=0)
    num_gpu_blocks_override: int | None = opt(
        None, "number of device KV blocks (wins over the memory budget)", ge=1)
    kv_cache_memory_bytes: int | None = opt(
        None, "device memory for the KV cache: bytes or a size like 2GiB", ge=1,
        parse=parse_size)
    gpu_memory_utilization: float = opt(0.9, "fraction of GPU memory the engine may use",
                                        gt=0, le=1)
    cpu_memory_bytes: int | None = opt(
        None, "on CPU, memory the engine may use for its weights, activations and KV cache "
        "(bytes or a size like 8GiB); default: 0.5 of the memory available at start", ge=1,
        parse=parse_size)
    watermark: float = opt(0.01, "fraction of blocks kept free when admitting new requests",
                           ge=0, lt=1)
    eviction_policy: EvictionPolicyName = opt(
        "lru", "which free cached KV block is evicted first: lru, lfu (fewest uses) or arc "
        "(adaptive recency/frequency)")
    max_pinned_fraction: float = opt(0.5, "most of the KV cache that pinned prefixes (/v1/pin) "
                                     "may hold", ge=0, lt=1)
    kv_cache_dtype: str = opt(
        "auto", "KV cache dtype: 'auto' (the model's), fp8 (= fp8_e4m3), fp8_e5m2 or int8 (a "
        "scale per token and head): one byte per value, about twice the blocks of bfloat16",
        choices=KV_CACHE_DTYPE_CHOICES)
    prefix_match_unit: int | None = opt(
        None, "prefix hits in units of this many tokens (a divisor of block_size; 1: any "
        "token), reusing part of a cached block by copy-on-write")
    disable_hybrid_kv_cache_manager: bool = opt(
        False, "models mixing sliding-window and full layers: keep full-attention blocks on "
        "every layer (no KV cache groups)")


@dataclass(kw_only=True)
class SchedulerOptions:
    """Each step's budgets and the order requests run and give blocks back in."""

    max_num_seqs: int = opt(DEFAULT_MAX_NUM_SEQS, "most sequences in one step", ge=1)
    max_num_batched_tokens: int | None = opt(
        None, "token budget of one step (longer prompts are chunked)", ge=1)
    preemption_mode: PreemptionMode = opt(
        "recompute", "how a request gives its blocks back when memory runs out")
    scheduling_policy: SchedulingPolicy = opt("fcfs", "'fcfs' or 'priority' (lower value "
                                              "first)")
    async_scheduling: bool = opt(False, "build the next step while the forward pass runs "
                                 "(same tokens)")
    long_prefill_token_threshold: int = opt(
        0, "most prompt tokens one request computes in a step: a long prompt is prefilled in "
        "chunks of this size, so the other requests' prefills and decodes run beside it; a "
        "request alone in the scheduler is not capped, as in vLLM (0: no cap but the step's "
        "budget)", ge=0)
    prefill_batching: PrefillBatching = opt(
        "auto", "how many waiting prompt tokens one step starts: 'auto' is 'spread' on CPU "
        "and 'fill' on a GPU (spread's step costs are a CPU step's); 'spread' starts about "
        "sqrt(queued prompt tokens x the step's overhead tokens), so a small wave of prompts "
        "reaches its first tokens in several smaller steps and the requests it releases come "
        "back staggered (lower mean TTFT at about the same throughput, TPOT the same or a "
        "little higher); a queue large against the overhead still fills the budget, and the "
        "queue's last prompt is not chunked when the next step holds it whole; 'fill' admits "
        "prompts into the whole step budget, the last one chunked (vLLM's rule)")
    prefill_step_overhead_tokens: int = opt(
        256, "with prefill_batching 'spread': a step's fixed cost, in prompt tokens of compute",
        ge=1)
    prefill_decode_overhead_tokens: int = opt(
        16, "with prefill_batching 'spread': what one decode sequence in the step costs, in "
        "prompt tokens of compute", ge=0)
    speculative_config: str | dict | None = opt(
        None, "speculative decoding, a JSON object: method (ngram or draft_model), "
        "num_speculative_tokens; ngram: prompt_lookup_min, prompt_lookup_max; draft_model: "
        "model (a draft model directory sharing the target's vocab)")


@dataclass(kw_only=True)
class StoreOptions:
    """The tiered KV store (pagedkv.store) below the device cache, and KV cache events."""

    kv_events_config: str | dict | None = opt(
        None, "publish KV cache events, a JSON object: enable_kv_cache_events, publisher (zmq), "
        "endpoint, topic")
    kv_offloading_size: float = opt(0.0, "GiB of host RAM for the KV store's host tier (0: "
                                    "none)", ge=0)
    kv_offloading_disk_path: str | None = opt(
        None, "directory of the KV store's disk tier (kept across restarts)", nonempty=True)
    kv_offloading_disk_size: float = opt(10.0, "GiB the disk tier may use", ge=0)
    kv_offloading_remote_url: str | None = opt(
        None, "Redis URL of the KV store's shared tier, e.g. redis://127.0.0.1:6379",
        nonempty=True)
    kv_transfer_config: str | dict | None = opt(
        None, "prefill/decode disaggregation, a JSON object (vLLM's): kv_role (kv_producer, "
        "kv_consumer, kv_both), kv_connector (PagedKVStoreConnector: through the shared tier; "
        "PagedKVPushConnector: pushed over ZMQ), kv_ip, kv_port, kv_buffer_size, "
        "kv_connector_extra_config")


@dataclass(kw_only=True)
class RuntimeOptions:
    """Where and how the model runs, and what the engine records."""

    device: Device = opt("auto", "'auto' picks cuda when present, else cpu")
    enforce_eager: bool = opt(False, "no CUDA graphs: run every decode step eagerly")
    cpu_kernels: CpuKernelMode = opt(
        "auto", "CPU: fused C++ kernels; auto: build in the background on first use and switch "
        "once built; wait: build before starting; off: pure torch")
    cpu_threads: int | None = opt(None, "CPU: compute threads (default: the cores other "
                                  "processes leave free, re-read every second)", ge=1)
    cpu_malloc: CpuMalloc = opt(
        "auto", "CPU: the engine core process's malloc; auto: tcmalloc preloaded where "
        "installed (libtcmalloc-minimal4), else glibc's; glibc: glibc's. A user's LD_PRELOAD "
        "wins; an engine in the caller's own process keeps the caller's malloc")
    step_log: str | None = opt(None, "append one JSON line per engine step (shape, seconds) to "
                               "this file, for `pagedkv profile --fit-from`")


@dataclass(kw_only=True)
class StructuredOptions:
    """Bounds on one structured-output constraint (pagedkv.structured.limits)."""

    structured_outputs_max_choices: int = opt(
        1024, "structured outputs: most alternatives of a choice list", ge=1)
    structured_outputs_max_pattern_chars: int = opt(
        16 * 1024, "structured outputs: longest regex (characters)", ge=1)
    structured_outputs_max_grammar_chars: int = opt(
        64 * 1024, "structured outputs: longest grammar, or total characters of a choice list",
        ge=1)
    structured_outputs_max_schema_chars: int = opt(
        64 * 1024, "structured outputs: longest JSON schema (characters of compact JSON)", ge=1)
    structured_outputs_compile_timeout_s: float = opt(
        10.0, "structured outputs: seconds a request waits for its constraint to compile (then "
        "a 400)", gt=0)
    structured_outputs_compile_threads: int = opt(
        2, "structured outputs: threads of the grammar compile pool", ge=1)


@dataclass(kw_only=True)
class ParallelOptions:
    """Tensor parallelism, over one machine or several (torchrun's names), and data parallelism."""

    tensor_parallel_size: int = opt(1, "split every layer over this many ranks (worker "
                                    "processes; gloo on CPU, NCCL on CUDA)", ge=1)
    distributed_timeout_s: float = opt(
        60.0, "tensor parallel: seconds a collective waits for the other ranks before the "
        "engine fails (a rank died or hung)", gt=0)
    nnodes: int = opt(1, "tensor parallel over several machines: how many (torchrun's "
                      "--nnodes)", ge=1)
    node_rank: int = opt(0, "this machine's index; 0 runs the engine, the others run only "
                         "their ranks", ge=0)
    master_addr: str = opt("127.0.0.1", "node 0's address, reachable from every machine (with "
                           "--nnodes > 1)")
    master_port: int | None = opt(None, "a free port on node 0 for the ranks' rendezvous (with "
                                  "--nnodes > 1)", ge=1, le=65535)
    distributed_executor_backend: ExecutorBackend = opt(
        "mp", "how the tensor-parallel ranks run: 'mp' worker processes (started here, or by "
        "`--node-rank K` on the other machines), 'ray' Ray actors placed on a running Ray "
        "cluster (one bundle per rank; one node per rank with --nnodes > 1; needs the ray extra)")
    data_parallel_size: int = opt(1, "data parallel: this many engine cores (each its own "
                                  "process, KV cache and scheduler, times tensor_parallel_size "
                                  "ranks) behind one frontend, each request placed on one by the "
                                  "kv-aware policy", ge=1)
    data_parallel_rank: int = opt(0, "this engine core's index among the data-parallel cores (set "
                                  "by the frontend: its KV events carry it)", ge=0)


# The groups of EngineArgs, in the order the flags and the reference page list them.
ENGINE_OPTION_GROUPS: tuple[type, ...] = (
    ModelOptions, CacheOptions, SchedulerOptions, StoreOptions, RuntimeOptions,
    StructuredOptions, ParallelOptions)


@dataclass(frozen=True)
class OptionSpec:
    """One declared option as the validators, the flags and the reference page read it.

    `kind`: "int", "float", "bool", "str" or "any" (a type no generic check covers);
    `choices`: the values it takes (or None); `nullable`: None is a value (the default
    decides)."""

    name: str
    kind: str
    nullable: bool
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    ge: float | None
    gt: float | None
    le: float | None
    lt: float | None
    parse: Callable[[str], Any] | None
    nonempty: bool
    flag: bool

    def bounds_text(self) -> str:
        """The range in words: 'in (0, 1]', '>= 0', ... ('' when unbounded)."""
        low = (f"[{self.ge:g}" if self.ge is not None else
               f"({self.gt:g}" if self.gt is not None else None)
        high = (f"{self.le:g}]" if self.le is not None else
                f"{self.lt:g})" if self.lt is not None else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return (">= " if low[0] == "[" else "> ") + low[1:]
        if high:
            return ("<= " if high[-1] == "]" else "< ") + high[:-1]
        return ""


_KINDS = {int: "int", float: "float", bool: "bool", str: "str"}


def _kind(annotation: Any) -> tuple[str, bool, tuple[Any, ...] | None]:
    """(kind, nullable, Literal choices) of a field's annotation."""
    args = typing.get_args(annotation)
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    nullable = is_union and type(None) in args
    rest = [a for a in args if a is not type(None)] if is_union else [annotation]
    if len(rest) != 1:
        return "any", nullable, None
    (base,) = rest
    if typing.get_origin(base) is Literal:
        return "str", nullable, typing.get_args(base)
    return _KINDS.get(base, "any"), nullable, None


@functools.cache
def option_specs(group: type) -> tuple[OptionSpec, ...]:
    """The declared options of a group (or of a class inheriting groups), in field order."""
    hints = typing.get_type_hints(group)
    specs = []
    for f in dataclasses.fields(group):
        if "help" not in f.metadata:
            continue
        kind, nullable, literal = _kind(hints[f.name])
        meta = f.metadata
        specs.append(OptionSpec(
            name=f.name, kind=kind, nullable=nullable, default=f.default, help=meta["help"],
            choices=literal or meta["choices"], ge=meta["ge"], gt=meta["gt"], le=meta["le"],
            lt=meta["lt"], parse=meta["parse"], nonempty=meta["nonempty"], flag=meta["flag"]))
    return tuple(specs)


def option_spec(name: str) -> OptionSpec:
    """The declaration of the engine option `name` (KeyError when there is none)."""
    for group in ENGINE_OPTION_GROUPS:
        for spec in option_specs(group):
            if spec.name == name:
                return spec
    raise KeyError(name)


def check_value(spec: OptionSpec, value: Any) -> None:
    """ValueError naming the option, the value and the limit unless `value` fits `spec`."""
    if value is None and spec.nullable:
        return
    name = spec.name
    if spec.choices is not None:
        if not isinstance(value, str) or value not in spec.choices:
            raise ValueError(f"{name} must be one of {spec.choices}, got {value!r}")
        return
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    elif spec.kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be {_int_words(spec)}, got {value!r}")
        _check_bounds(spec, value, _int_words(spec))
    elif spec.kind == "float":
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number{_bounds_suffix(spec)}, "
                             f"got {value!r}")
        _check_bounds(spec, value, f"a number {spec.bounds_text()}".rstrip())
    elif spec.kind == "str" and spec.nonempty and (not isinstance(value, str) or not value):
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def _int_words(spec: OptionSpec) -> str:
    if spec.ge == 1 and spec.le is None and spec.lt is None:
        return "a positive integer"
    return f"an integer {spec.bounds_text()}".rstrip()


def _bounds_suffix(spec: OptionSpec) -> str:
    bounds = spec.bounds_text()
    return f" {bounds}" if bounds else ""


def _check_bounds(spec: OptionSpec, value: float, words: str) -> None:
    if ((spec.ge is not None and value < spec.ge) or (spec.gt is not None and value <= spec.gt)
            or (spec.le is not None and value > spec.le)
            or (spec.lt is not None and value >= spec.lt)):
        raise ValueError(f"{spec.name} must be {words}, got {value!r}")


def check_options(obj: Any, *groups: type) -> None:
    """Check every declared option `obj` has (those of `groups`, default: `obj`'s own class)
    against its declaration: type, range, choices. ValueError naming the first bad one."""
    for group in groups or (type(obj),):
        for spec in option_specs(group):
            if hasattr(obj, spec.name):
                check_value(spec, getattr(obj, spec.name))
