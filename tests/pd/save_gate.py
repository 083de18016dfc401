"""A gate on the store writes of an engine's tensor-parallel worker ranks (ranks 1..N-1, spawned
processes): while the gate file exists, their host and disk tiers' writes wait (at most
HOLD_S), so a test can hold one rank's saves back while rank 0's go through. The worker
interpreters load the hook as `sitecustomize` from a directory put first on PYTHONPATH."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

HOLD_S = 20.0
SITECUSTOMIZE = f"""
import os, time
_gate = os.environ.get("PAGEDKV_TEST_SAVE_GATE")
if _gate:
    from pagedkv.store import disk as _disk, host as _host

    def _held(real, gate=_gate):
        def put_many(self, items):
            deadline = time.monotonic() + {HOLD_S}
            while os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.005)
            return real(self, items)
        return put_many

    _host.HostTier.put_many = _held(_host.HostTier.put_many)
    _disk.DiskTier.put_many = _held(_disk.DiskTier.put_many)
"""


@contextlib.contextmanager
def worker_save_gate(hooks: Path, gate: Path) -> Iterator[None]:
    """Within it, worker ranks started hold their store writes while `gate` exists (the
    gate is removed on exit)."""
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PAGEDKV_TEST_SAVE_GATE", str(gate))
        env.setenv("PYTHONPATH", f"{hooks}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        try:
            yield
        finally:
            gate.unlink(missing_ok=True)
