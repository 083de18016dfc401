"""Which kernel runs each CPU linear, by rows, chosen by measuring the candidates on this CPU
(and the timing, table file and modes that model/prefill_choice.py's prefill attention choice
shares).

The fastest kernel for a linear depends on the CPU, the dtype, the weight's shape and the rows
of the input: on an Intel CPU with AMX, oneDNN's bfloat16 linear (through torch) beats the
`panel_linear` kernels from about 8 rows and by 10x at 2,048, while the panels win at 1-4 rows;
on AMD Zen 4/5 (no AMX) the panels win throughout. oneDNN comes two ways: its inner product on
the weight pre-packed in its blocked layout ("onednn", `_linear_pointwise`), and its matmul on
the weight transposed once to [in, out] ("matmul", torch.mm), which on an AMX CPU is about
1.4x the inner product for a prefill's wide gate_up product (1,536 x 512 x 2,816) and slower
for a few hundred rows. So no rule keyed on the instruction set is
right everywhere: each shape class (dtype, N x K, bias) is timed once per rows bucket
(ROW_BUCKETS, each at its representative row count), the candidates alternating call by call
and each keeping its fastest call, and the fastest wins; the kernel in place ("panel", listed
first) keeps a bucket unless another beats it by KEEP_MARGIN (noise does not flip it, and a
weight keeps one prepared copy where it can).

The timing runs on one thread and counts its CPU time (time.thread_time): on a shared machine
the time other processes hold a core does not count, where wall-clock timing of two threads
was swamped by it (a call either ran clean or lost a scheduler slice of milliseconds). Both
kernels split a product's columns over torch's threads alike, so the one-thread winner is
taken for every thread count (the engine's governor changes the count while it runs).

The table is cached on disk (`table_path()`: in the kernel cache folder, one file per CPU model
and flags, torch version and kernel build), so a second start measures nothing; in-process it
is cached per shape class.

PAGEDKV_KERNEL_CHOICE forces a fixed choice (deterministic tests, before/after benchmarks):
- "measure" (default): as above.
- "panel": the panels for every linear and rows.
- "onednn": oneDNN for every linear it takes natively (float32; bfloat16 where the CPU has
  bfloat16 dot products), the panels for the rest.
- "isa": the instruction-set rule (panels, but oneDNN for bfloat16 where the build's panels
  have no bfloat16 dot products and oneDNN has: kernels.cpu.PANELS_BEAT_ONEDNN_BF16).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "PAGEDKV_KERNEL_CHOICE"
CHOICE_MODES = ("measure", "panel", "onednn", "isa")
KERNELS = ("panel", "onednn", "matmul")
# (first, last) rows of each bucket; the last one is open-ended (its last is the row count it
# is measured at). A linear's rows are a step's tokens: decode batches, then prefill chunks.
ROW_BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 64),
                                            (65, 256), (257, 512), (513, 1024))
ROUTE_LAST = ROW_BUCKETS[-1][0]  # rows_route(...)[min(rows, ROUTE_LAST)]: the bucket's kernel
KEEP_MARGIN = 1.08  # another kernel takes a bucket from "panel" when this much faster
BUDGET_S = 0.004  # timing per bucket, past the minimum calls
MIN_CALLS, MAX_CALLS = 3, 40
DROP_RATIO = 3.0  # a candidate this much slower than the best stops being timed

_tables: dict[str, tuple[str, ...]] = {}  # shape class -> kernel per bucket
_in_use: dict[str, tuple[str, ...]] = {}  # shape class -> kernel per bucket, as last chosen


def choice_mode() -> str:
    """PAGEDKV_KERNEL_CHOICE (default "measure"); ValueError naming any other value."""
    mode = os.environ.get(ENV, "measure") or "measure"
    if mode not in CHOICE_MODES:
        raise ValueError(f"{ENV} must be one of {CHOICE_MODES}, got {mode!r}")
    return mode


def bucket_label(bucket: tuple[int, int]) -> str:
    first, last = bucket
    if bucket == ROW_BUCKETS[-1]:
        return f"{first}+"
    return str(first) if first == last else f"{first}-{last}"


def shape_class(dtype: torch.dtype, out_features: int, in_features: int, bias: bool) -> str:
    """A linear's shape class, the table's key: "bfloat16 1024x512" (+ " bias")."""
    name = str(dtype).removeprefix("torch.")
    return f"{name} {out_features}x{in_features}" + (" bias" if bias else "")


def rows_route(per_bucket: tuple[str, ...]) -> tuple[str, ...]:
    """The kernel for each row count 0..ROUTE_LAST (index min(rows, ROUTE_LAST)), from one
    kernel per ROW_BUCKETS bucket: a per-call lookup with no arithmetic."""
    route = [per_bucket[0]]
    for (first, last), kernel in zip(ROW_BUCKETS, per_bucket, strict=True):
        route += [kernel] * (min(last, ROUTE_LAST) - first + 1)
    return tuple(route)


# What holds oneDNN and torch's own CPU kernels below the CPU's widest instructions.
ISA_CAPS_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def _machine_parts() -> dict[str, str]:
    """What a measured table is valid for (see the module docstring)."""
    from pagedkv.kernels.cpu import _cpu_flags, build_key

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    parts = {"cpu": models[0] if models else platform.machine(), "flags": _cpu_flags(),
             "torch": torch.__version__, "kernels": build_key(),
             "timing": "one thread, its CPU time"}
    # oneDNN's and torch's own kernels held below the CPU's widest instructions (an AMD CPU's
    # paths run on an Intel one, `make test-isa`) time otherwise: a table of their own.
    for name in ISA_CAPS_ENV:
        if os.environ.get(name):
            parts[name] = os.environ[name]
    return parts


def table_path() -> Path:
    """This CPU's, torch's and kernel build's table of measured choices."""
    from pagedkv.kernels.cpu import kernel_cache_dir

    parts = _machine_parts()
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return kernel_cache_dir() / "choice" / f"choice-{digest}.json"


def _read_disk(path: Path, section: str) -> dict:
    """`section` ("linears", "prefill_attention") of the table file; {} without a readable one."""
    try:
        table = json.loads(path.read_text())[section]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return table if isinstance(table, dict) else {}


def _write_disk(path: Path, section: str, key: str, value: object) -> None:
    """Add `key`'s entry to the file's `section` (read, merge, write to a temporary name,
    rename: a reader never sees half a file; a lost race costs one re-measurement, never a
    wrong table)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        data["machine"] = _machine_parts()
        data.setdefault(section, {})[key] = value
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except (OSError, TypeError, AttributeError) as e:
        logger.warning("could not cache the kernel choice in %s: %s", path, e)


def cached_choice(section: str, key: str, valid: Callable[[object], bool],
                  measure: Callable[[], object]) -> object:
    """The table file's `section`/`key` entry where `valid`, else `measure()` (logged, then
    written there)."""
    path = table_path()
    cached = _read_disk(path, section).get(key)
    if cached is not None and valid(cached):
        return cached
    logger.info("timing the CPU kernels for %s %s (once per machine; cached in %s)",
                section, key, path.parent)
    started = time.perf_counter()
    value = measure()
    logger.debug("kernel choice for %s %s measured in %.0f ms: %s", section, key,
                 1e3 * (time.perf_counter() - started), value)
    _write_disk(path, section, key, value)
    return value


def time_candidates(calls: Mapping[str, Callable[[], object]]) -> dict[str, float]:
    """{name: fastest call in this thread's CPU seconds}: one untimed call each, then rounds
    alternating the candidates call by call (a busy moment hits them alike) until MIN_CALLS
    rounds and BUDGET_S have passed (at most MAX_CALLS); a candidate DROP_RATIO slower than the best
    stops being called."""
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    started, rounds = time.thread_time(), 0
    while rounds < MIN_CALLS or (rounds < MAX_CALLS and time.thread_time() - started < BUDGET_S):
        floor = min(best.values())
        for name, call in calls.items():
            if rounds and best[name] > DROP_RATIO * floor:
                continue
            t0 = time.thread_time()
            call()
            best[name] = min(best[name], time.thread_time() - t0)
        rounds += 1
    return best


def pick(times: Mapping[str, float]) -> str:
    """The fastest of `times`, the first listed keeping it unless another is KEEP_MARGIN
    faster."""
    incumbent = next(iter(times))
    fastest = min(times, key=times.__getitem__)
    return fastest if times[fastest] * KEEP_MARGIN < times[incumbent] else incumbent


def measure_linear(dtype: torch.dtype, in_features: int,
                   kernels: Mapping[str, Callable[[torch.Tensor], torch.Tensor]]
                   ) -> tuple[str, ...]:
    """The fastest of `kernels` (name -> f(x) -> y) for each ROW_BUCKETS bucket, measured at
    the bucket's last row count on one thread (torch's thread count is restored after)."""
    gen = torch.Generator().manual_seed(0)
    chosen = []
    with one_thread():
        for _, rows in ROW_BUCKETS:
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            times = time_candidates({name: (lambda f=f, x=x: f(x))
                                     for name, f in kernels.items()})
            chosen.append(pick(times))
    return tuple(chosen)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside (where the timing runs), its thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def choose_linear(shape: str, dtype: torch.dtype, in_features: int,
                  make: Callable[[str], Callable[[torch.Tensor], torch.Tensor]],
                  available: tuple[str, ...], isa_rule: str) -> tuple[str, ...]:
    """The kernel of each ROW_BUCKETS bucket for linears of `shape` (`shape_class`), among
    `available` (KERNELS' names, the in-place one first), per `choice_mode()`: forced, the
    instruction-set rule's `isa_rule`, or measured (`make(name)` builds a kernel of the layer's
    weight: f(x) -> y), cached in-process and on disk."""
    per_bucket = _choose_linear(shape, dtype, in_features, make, available, isa_rule)
    _in_use[shape] = per_bucket
    return per_bucket


def _choose_linear(shape: str, dtype: torch.dtype, in_features: int,
                   make: Callable[[str], Callable[[torch.Tensor], torch.Tensor]],
                   available: tuple[str, ...], isa_rule: str) -> tuple[str, ...]:
    mode = choice_mode()
    if len(available) == 1 or mode != "measure":
        fixed = isa_rule if mode in ("isa", "measure") else mode
        kernel = fixed if fixed in available else available[0]
        return (kernel,) * len(ROW_BUCKETS)
    if not set(_tables.get(shape, ("",))) <= set(available):
        def valid(v: object) -> bool:
            return isinstance(v, list) and len(v) == len(ROW_BUCKETS) and set(v) <= set(available)

        table = cached_choice(
            "linears", shape, valid,
            lambda: list(measure_linear(dtype, in_features, {k: make(k) for k in available})))
        _tables[shape] = tuple(table)
    return _tables[shape]


def describe_kernels(per_bucket: tuple[str, ...]) -> str:
    """One bucket table in words: "panel at 1-4 rows, onednn at 5+ rows"."""
    runs: list[list] = []
    for bucket, kernel in zip(ROW_BUCKETS, per_bucket, strict=True):
        if runs and runs[-1][0] == kernel:
            runs[-1][2] = bucket
        else:
            runs.append([kernel, bucket, bucket])
    parts = []
    for kernel, first, last in runs:
        open_ended = last == ROW_BUCKETS[-1]
        span = f"{first[0]}+" if open_ended else bucket_label((first[0], last[1]))
        parts.append(f"{kernel} at {span} rows")
    return ", ".join(parts)


def choice_table() -> dict[str, dict[str, str]]:
    """The measured choices of this process: {shape class: {bucket label: kernel}} (empty
    before any linear was measured, or with a forced mode)."""
    return {shape: dict(zip(map(bucket_label, ROW_BUCKETS), kernels, strict=True))
            for shape, kernels in sorted(_tables.items())}


def linears_in_use() -> dict[str, dict[str, str]]:
    """The kernels this process chose for its linears, measured or forced: {shape class:
    {bucket label: kernel}} (the last choice of each class)."""
    return {shape: dict(zip(map(bucket_label, ROW_BUCKETS), kernels, strict=True))
            for shape, kernels in sorted(_in_use.items())}


def describe_choice() -> str:
    """The linears' kernel choice in words for a start-up banner: the mode when forced, else
    each dtype's rows split (per shape class where the classes of a dtype differ)."""
    mode = choice_mode()
    if mode != "measure":
        return f"linears: {mode} ({ENV})"
    by_dtype: dict[str, dict[str, tuple[str, ...]]] = {}
    for shape, kernels in sorted(_tables.items()):
        by_dtype.setdefault(shape.split()[0], {})[shape] = kernels
    if not by_dtype:
        return "linears: measured per shape"
    parts = []
    for dtype, shapes in by_dtype.items():
        if len(set(shapes.values())) == 1:
            parts.append(f"{dtype} linears: {describe_kernels(next(iter(shapes.values())))}")
        else:
            parts.append(f"{dtype} linears: " + "; ".join(
                f"{shape.split(' ', 1)[-1]}: {describe_kernels(k)}" for shape, k in shapes.items()))
    return "; ".join(parts)
