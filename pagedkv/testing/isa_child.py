"""Run Python code in a child process whose CPU kernels are built for another instruction set.

The kernel library is one per process (pagedkv.kernels.cpu loads it once), so the AVX2 build
(Zen 3's 8-wide code; `PAGEDKV_CPU_ISA=avx2`) is checked on an AVX-512 machine in a child. The
tests of each kernel hand it a snippet that prints one JSON value as its last line. The child
shares this process's kernel cache folder (its build has a key of its own there, so it is built
once and kept for the next run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from pagedkv.kernels.cpu import kernel_cache_dir


def run_with_isa(code: str, isa: str = "avx2", extra_path: tuple[str, ...] = (),
                 timeout_s: float = 900) -> Any:
    """The JSON value `code` prints last, run by this interpreter with PAGEDKV_CPU_ISA=`isa` and
    `extra_path` ahead of this process's sys.path. AssertionError with the child's stderr tail
    when it fails; subprocess.TimeoutExpired after `timeout_s`."""
    env = {**os.environ, "PAGEDKV_CPU_ISA": isa, "PAGEDKV_KERNEL_CACHE_DIR": str(kernel_cache_dir()),
           "PYTHONPATH": os.pathsep.join([*extra_path, *sys.path])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
