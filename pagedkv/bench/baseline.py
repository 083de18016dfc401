"""Another commit's `pagedkv`, for benchmarks that compare this tree against a baseline."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
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
