"""Engine steps of a serving run, pagedkv's and vLLM's side by side (`bench_serve.py --steps`):
what each step computed (prompt tokens, decode sequences) and how long it took, read from
pagedkv's step log (`--step-log`, pagedkv/engine/step_log.py: `own_seconds`, the step alone)
and from vLLM's log with `--enable-logging-iteration-details` (`iteration elapsed time`: its
engine core's step, scheduling to outputs). Plain Python: vLLM is never imported.

The steps are grouped into classes (decode-only by batch size, steps carrying prompt tokens
by how many) so that the two engines' schedules can be compared class by class: how many
steps of each kind the same load took (the scheduling) and the median time of one (the
kernels).
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

_VLLM_ITERATION = re.compile(
    r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, (\d+) generation "
    r"requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms")
# (upper bound, label) of the step classes, by decode batch / by prompt tokens.
_DECODE_CLASSES = ((1, "1"), (16, "2-16"), (64, "17-64"), (1 << 30, "65+"))
_PREFILL_CLASSES = ((256, "1-256"), (1024, "257-1024"), (2047, "1025-2047"),
                    (1 << 30, "2048+"))


@dataclass(frozen=True)
class Step:
    """One engine step: prompt tokens computed, decode sequences, milliseconds."""

    prefill_tokens: int
    decode_seqs: int
    ms: float

    @property
    def kind(self) -> str:
        """The step's class: `decode b=2-16` or `prompt 257-1024 tok` (with any decodes)."""
        if self.prefill_tokens:
            label = next(name for top, name in _PREFILL_CLASSES if self.prefill_tokens <= top)
            return f"prompt {label} tok"
        label = next(name for top, name in _DECODE_CLASSES if self.decode_seqs <= top)
        return f"decode b={label}"


def pagedkv_steps(path: str | Path) -> list[Step]:
    """The steps of pagedkv's step log at `path` (none when it was not written)."""
    path = Path(path)
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        steps.append(Step(row["prefill_tokens"], row["decode_seqs"],
                          1000 * row.get("own_seconds", row["seconds"])))
    return steps


def vllm_steps(log_text: str) -> list[Step]:
    """The steps in vLLM's log (its iteration details lines)."""
    return [Step(int(m[2]), int(m[4]), float(m[5])) for m in _VLLM_ITERATION.finditer(log_text)]


def step_table(steps: list[Step]) -> dict[str, tuple[int, float, float]]:
    """Per class: (steps, median ms, total ms), classes in a fixed order."""
    by_kind: dict[str, list[float]] = {}
    for step in steps:
        by_kind.setdefault(step.kind, []).append(step.ms)
    order = [f"decode b={n}" for _, n in _DECODE_CLASSES] + \
        [f"prompt {n} tok" for _, n in _PREFILL_CLASSES]
    return {k: (len(by_kind[k]), statistics.median(by_kind[k]), sum(by_kind[k]))
            for k in order if k in by_kind}


def same_shapes(ours: list[Step], theirs: list[Step]) -> int:
    """Steps, position by position, that computed the same prompt tokens and decodes in both
    runs of one load: how far the two schedulers built the same steps."""
    return sum((a.prefill_tokens, a.decode_seqs) == (b.prefill_tokens, b.decode_seqs)
               for a, b in zip(ours, theirs, strict=False))


def print_step_tables(tables: dict[str, list[Step]]) -> None:
    """Each engine's steps class by class: count, median ms, share of the step time."""
    for kind, steps in tables.items():
        table = step_table(steps)
        total = sum(t for _, _, t in table.values()) or 1.0
        print(f"  steps of {kind}: {len(steps)} steps, {sum(s.prefill_tokens for s in steps)} "
              f"prompt tokens, {total / 1000:.1f} s")
        for name, (count, median, spent) in table.items():
            print(f"    {name:20} {count:5} steps  median {median:7.1f} ms  "
                  f"{100 * spent / total:5.1f}% of the time")
    if len(tables) == 2:
        ours, theirs = tables.values()
        print(f"  the same step, position by position: {same_shapes(ours, theirs)} of "
              f"{len(ours)} / {len(theirs)} steps (the rest differ by when requests arrived)")
