"""`pagedkv serve` with the engine core in its own process (issue 26): a core
that dies ends the server with a clear error and exit code 1, instead of a hang or 503s for
ever."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.server.helpers import ENGINE_KWARGS, ServerProcess, descendants, engine_flags

pytestmark = pytest.mark.timeout(240)


def test_a_killed_core_process_ends_the_server_with_a_reason(tiny_llama):
    proc = ServerProcess(tiny_llama, *engine_flags(**ENGINE_KWARGS),
                         "--engine-core", "process").start()
    try:
        ok = httpx.post(proc.url + "/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        cores = descendants(proc.proc.pid, "pagedkv.engine.core_proc")
        assert len(cores) == 1
        os.kill(cores[0], signal.SIGKILL)
        assert proc.proc.wait(timeout=30) == 1
        output = proc.output()
        assert "engine core process" in output and "exiting because the engine failed" in output
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()

