"""Run Python code in a child process whose CPU kernels are built for another instruction set.

The kernel library is one per process (pagedkv.kernels.cpu loads it once), so the AVX2 build
(Zen 3's 8-wide code; `PAGEDKV_CPU_ISA=avx2`) is checked on an AVX-512 machine in a child. The
tests of each kernel hand it a snippet that prints one JSON value as its last line. The child
shares this process's kernel cache folder (its build has a key of its own there, so it is built
once and kept for the next run).

One child per instruction set serves every snippet this process sends it, one at a time (each
in fresh globals): starting an interpreter, importing torch and loading the library cost some
CPU-seconds, once instead of once per check. It ends when this process does.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any

from pagedkv.kernels.cpu import kernel_cache_dir

# The child's loop: one JSON request a line on stdin ({"code", "path"}), one JSON answer a line
# on the descriptor that was stdout ({"value"} or {"error"}); anything else the snippets, the
# compiler or a library write to stdout goes to stderr instead.
_SERVE = r"""
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    request = json.loads(line)
    for entry in reversed(request["path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(request["code"], "<snippet>", "exec"), {"__name__": "__snippet__"})
        answer = {"value": json.loads(printed.getvalue().strip().splitlines()[-1])}
    except BaseException:
        answer = {"error": traceback.format_exc()}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
"""


class _Child:
    """An interpreter with PAGEDKV_CPU_ISA=`isa` running the snippets it is sent."""

    def __init__(self, isa: str) -> None:
        env = {**os.environ, "PAGEDKV_CPU_ISA": isa,
               "PAGEDKV_KERNEL_CACHE_DIR": str(kernel_cache_dir()),
               "PYTHONPATH": os.pathsep.join(sys.path)}
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr)
        self.answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.answers.put(line)
        self.answers.put(None)  # the child is gone

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-3000:]

    def run(self, code: str, extra_path: tuple[str, ...], timeout_s: float) -> dict:
        """The child's answer to `code`; raises subprocess.TimeoutExpired (the child killed)
        after `timeout_s`, AssertionError when the child died."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"code": code, "path": list(extra_path)}) + "\n")
        self.proc.stdin.flush()
        try:
            line = self.answers.get(timeout=timeout_s)
        except queue.Empty:
            self.close(kill=True)
            raise subprocess.TimeoutExpired(self.proc.args, timeout_s) from None
        if line is None:
            self.close(kill=True)
            raise AssertionError(f"the {self.proc.args[0]} child exited with "
                                 f"{self.proc.returncode}:\n{self.stderr_tail()}")
        return json.loads(line)

    def close(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        elif self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


_children: dict[tuple[str, str], _Child] = {}


@atexit.register
def _close_children() -> None:
    while _children:
        _children.popitem()[1].close()


def run_with_isa(code: str, isa: str = "avx2", extra_path: tuple[str, ...] = (),
                 timeout_s: float = 900) -> Any:
    """The JSON value `code` prints last, run (in fresh globals) by this process's child with
    PAGEDKV_CPU_ISA=`isa`, `extra_path` ahead of this process's sys.path. AssertionError with
    the traceback (and the child's stderr tail) when it fails; subprocess.TimeoutExpired after
    `timeout_s`."""
    key = (isa, str(kernel_cache_dir()))
    if key not in _children or _children[key].proc.poll() is not None:
        _children[key] = _Child(isa)
    child = _children[key]
    try:
        answer = child.run(code, extra_path, timeout_s)
    except (AssertionError, subprocess.TimeoutExpired):
        _children.pop(key, None)
        raise
    assert "error" not in answer, answer.get("error", "") + child.stderr_tail()
    return answer["value"]
