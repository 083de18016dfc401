"""The engine core process's life follows its frontend's (issue 43): a SIGTERM sent to the
whole process group (systemd's and supervisord's group stop) drains exactly as one sent to the
server alone, and a frontend killed outright (SIGKILL) leaves no core, no tensor-parallel
worker and no private IPC folder behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import ServerProcess, descendants, engine_flags, scrape

pytestmark = pytest.mark.timeout(240)

# The core and its workers are gone this soon after the frontend died: about a second on a
# quiet machine, up to 3.5 s measured on a 2-core box under a load of 20; 10-30 s without
# the frontend pipe.
ORPHAN_EXIT_S = 6.0


def _stream(url: str, body: dict, into: list, opened: threading.Semaphore | None = None) -> None:
    """POST a streamed completion and append its SSE data lines to `into`; release `opened`
    once the response's headers came (the server has handed the request to its core)."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as resp:
        if opened is not None:
            opened.release()
        into.append([line.removeprefix("data: ") for line in resp.iter_lines()
                     if line.startswith("data: ")])


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (gone, or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _ipc_folder(core_pid: int) -> Path:
    """The core's private IPC folder, read from its command line (its first argument is
    ipc://FOLDER/in)."""
    argv = Path(f"/proc/{core_pid}/cmdline").read_bytes().split(b"\0")
    in_addr = argv[argv.index(b"pagedkv.engine.core_proc") + 1].decode()
    return Path(in_addr.removeprefix("ipc://")).parent


def test_group_sigterm_drains_every_stream_and_exits_zero(tiny_llama):
    proc = ServerProcess(tiny_llama, *engine_flags(dtype="float32", block_size=4,
                                                   max_model_len=2048,
                                                   num_gpu_blocks_override=2048),
                         "--engine-core", "process", "--shutdown-timeout", "60")
    proc.new_session = True  # its own process group, to signal it as a service manager does
    proc.start()
    streams: list = []
    # long enough that the four streams still run when the test signals the group
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "temperature": 0.0}
    try:
        # The core holds still while the four requests reach it, so none can finish before
        # the last arrives however unevenly the client threads run.
        core, = descendants(proc.proc.pid, "pagedkv.engine.core_proc")
        os.kill(core, signal.SIGSTOP)
        opened = threading.Semaphore(0)
        threads = [threading.Thread(target=_stream, args=(proc.url, body, streams, opened))
                   for _ in range(4)]
        for t in threads:
            t.start()
        try:
            for _ in threads:
                assert opened.acquire(timeout=60), "a stream was never opened"
        finally:
            os.kill(core, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while scrape(proc.url)["pagedkv:num_requests_running"] < 4:
            assert time.monotonic() < deadline, "the four streams never ran together"
            time.sleep(0.02)
        assert descendants(proc.proc.pid, "pagedkv.engine.core_proc")
        os.killpg(proc.proc.pid, signal.SIGTERM)  # the server, its core, everything
        for t in threads:
            t.join(timeout=90)
        assert proc.proc.wait(timeout=90) == 0, proc.output()
    finally:
        if proc.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.proc.pid, signal.SIGKILL)
    assert len(streams) == 4
    for events in streams:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0
    assert "Traceback" not in proc.output()


@pytest.mark.slow
def test_a_killed_frontend_leaves_no_core_worker_or_folder(tiny_llama):
    proc = ServerProcess(tiny_llama, *engine_flags(
        dtype="float32", block_size=4, max_model_len=1024, num_gpu_blocks_override=512,
        tensor_parallel_size=2, cpu_kernels="off", distributed_timeout_s=60.0),
        "--engine-core", "process").start()
    streams: list = []
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
    cores: list[int] = []
    workers: list[int] = []
    try:
        cores = descendants(proc.proc.pid, "pagedkv.engine.core_proc")
        assert len(cores) == 1
        workers = descendants(cores[0], "spawn_main")
        assert workers, "no tensor-parallel worker found"
        folder = _ipc_folder(cores[0])
        assert folder.is_dir()
        thread = threading.Thread(target=_stream_quietly, args=(proc.url, body, streams))
        thread.start()
        deadline = time.monotonic() + 60
        while scrape(proc.url)["pagedkv:num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.proc.kill()
        proc.proc.wait(10)
        killed = time.monotonic()
        while not all(_gone(pid) for pid in (*cores, *workers)) or folder.exists():
            assert time.monotonic() - killed < ORPHAN_EXIT_S, (
                f"alive: {[p for p in (*cores, *workers) if not _gone(p)]}, "
                f"folder there: {folder.exists()}")
            time.sleep(0.05)
        thread.join(30)
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
        for pid in (*cores, *workers):  # left over only when the test failed
            if not _gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _stream_quietly(url: str, body: dict, into: list) -> None:
    with contextlib.suppress(httpx.HTTPError):
        _stream(url, body, into)
