"""Helpers of the server tests: a real `pagedkv serve` process on a free loopback port.

`ServerProcess` starts `python -m pagedkv.cli serve MODEL_DIR ...`, waits for /health, and is
stopped (SIGTERM, then SIGKILL if it hangs) by the fixtures' teardown (conftest.py).

Where the engine core runs: a server started without `--engine-core` takes
$PAGEDKV_ENGINE_CORE, and `engine_core_process()` tells the tests that build their own engine
the same. tests/conftest.py sets it to `inproc` unless it is set already (a core in its own
process costs 2-3 CPU-seconds more per start), so the tests about the process split (the core's
pid, its death, its restarts, utility calls across it) pass `--engine-core process` or
`core_process=True` themselves, and `PAGEDKV_ENGINE_CORE=process pytest tests/server` (`make
test-process`) runs every other server test with the core in its own process too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pagedkv.commands.serve import engine_core_mode

STARTUP_TIMEOUT_S = 300.0  # torch import + model load on a busy 2-core box (180 s fell short)
STOP_TIMEOUT_S = 60.0  # SIGTERM to exit, on the same box
REPO_ROOT = Path(__file__).resolve().parents[2]

# Engine flags shared by the servers and the offline reference they are compared with.
ENGINE_KWARGS = dict(dtype="float32", block_size=4, max_model_len=1024,
                     num_gpu_blocks_override=1024, seed=0)


def engine_flags(**kwargs: object) -> list[str]:
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def engine_core_process() -> bool:
    """Whether `pagedkv serve` (and so a test's own engine) runs the engine core in its own
    process here (see the module docstring)."""
    return engine_core_mode(None) == "process"


def descendants(pid: int, marker: str = "") -> list[int]:
    """The ids of `pid`'s descendant processes (children, theirs, ...) whose command line
    contains `marker` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):  # it exited meanwhile
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                if marker.encode() in cmdline:
                    found.append(int(child))
                found += descendants(int(child), marker)
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A `pagedkv serve` subprocess; `url` is its base URL once `start()` returned."""

    def __init__(self, model_dir: Path, *args: str, model_name: str | None = "tiny") -> None:
        self.model_dir = model_dir
        self.model_name = model_name
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, log_path = tempfile.mkstemp(prefix="pagedkv-serve-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.new_session = False  # True: its own process group (a group-wide signal spares us)

    def command(self) -> list[str]:
        """The command line `start` runs (a subclass may start another subcommand)."""
        cmd = [sys.executable, "-m", "pagedkv.cli", "serve", str(self.model_dir),
               "--port", str(self.port), "--log-level", "warning", *self.args]
        if self.model_name is not None:  # else the server's default: the directory's name
            cmd += ["--served-model-name", self.model_name]
        return cmd

    def start(self) -> ServerProcess:
        cmd = self.command()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PAGEDKV_API_KEY", None)
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=self.new_session)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        output = self.output()  # before stop() removes the log
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{output}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> bool:
        """SIGTERM, wait, SIGKILL if needed. True when it stopped by itself on SIGTERM with exit
        code 0 (a graceful drain) and no traceback in its output."""
        if self.proc is None:
            return False
        clean = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:  # a clean exit took 8-11 s on a 2-core machine under a load of 18
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                clean = False
                self.proc.kill()
                self.proc.wait(timeout=10)
        clean = clean and self.proc.returncode == 0
        clean = clean and "Traceback" not in self.output()
        self.log_path.unlink(missing_ok=True)
        return clean


def scrape(url: str) -> dict[str, float]:
    """The server's pagedkv:* samples (labels dropped, histogram buckets skipped)."""
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedkv:") and "_bucket" not in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def wait_for_idle_pool(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no request runs, waits or is swapped and no block is held; return
    the metrics. Fails (AssertionError) when the pool is still busy after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url)
        idle = (metrics["pagedkv:num_requests_running"] == 0
                and metrics["pagedkv:num_requests_waiting"] == 0
                and metrics["pagedkv:num_requests_swapped"] == 0
                and metrics["pagedkv:kv_cache_usage_perc"] == 0)
        if idle:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is still busy after {timeout} s: {metrics}")
        time.sleep(0.05)


@contextmanager
def serving(proc: ServerProcess) -> Iterator[ServerProcess]:
    """Start `proc`, yield it, then check that it ends idle (no block held) and healthy and
    that SIGTERM stops it cleanly (exit 0, no traceback)."""
    proc.start()
    try:
        yield proc
        metrics = wait_for_idle_pool(proc.url)
        assert metrics["pagedkv:kv_cache_usage_perc"] == 0.0
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
    finally:
        clean = proc.stop()
    assert clean, "server did not shut down cleanly"
