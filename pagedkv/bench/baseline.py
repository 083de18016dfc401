"""Another commit's `pagedkv`, for benchmarks that compare this tree against a baseline."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def baseline_tree(checkout: str | Path, rev: str) -> Iterator[str]:
    """A temporary directory holding `rev`'s `pagedkv` package (`git archive` of the checkout
    `checkout`), for a child process's PYTHONPATH; removed on exit. Raises
    subprocess.CalledProcessError for a revision git does not know."""
    with tempfile.TemporaryDirectory() as base:
        archive = subprocess.run(["git", "-C", str(checkout), "archive", rev, "pagedkv"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        yield base


def alternate_with_baseline(checkout: str | Path, rev: str, cmd: Sequence[str], keys: Sequence[str],
                            repeat: int, say: Callable[[str, dict], str]) -> dict[str, dict]:
    """Run `cmd` (a benchmark printing one JSON line last) `repeat` times with `rev`'s
    `pagedkv` and this checkout's on PYTHONPATH, alternating; printing `say(name, result)`
    after each run. Returns {"base": {key: [values]}, "this": {key: [values]}} for `keys`."""
    runs: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
    with baseline_tree(checkout, rev) as base:
        for _ in range(repeat):
            for name, tree in (("base", base), ("this", str(checkout))):
                out = subprocess.run(list(cmd), env={**os.environ, "PYTHONPATH": tree},
                                     capture_output=True, text=True, check=True).stdout
                got = json.loads(out.splitlines()[-1])
                for key in keys:
                    runs[name].setdefault(key, []).append(got[key])
                print(say(name, got), flush=True)
    return runs


def median_ratio(runs: dict[str, dict], key: str) -> float:
    """The median over rounds of this tree's `key` over the baseline's."""
    this, was = runs["this"][key], runs["base"][key]
    return statistics.median(t / b for t, b in zip(this, was, strict=True))
